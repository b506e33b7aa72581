"""A directory's tokenizer, loaded once per process for the same files.

Every task of an iteration loads the tokenizer of the policy or checkpoint it was handed (rollout, score, train, the
train task's decks), and every version carries the same tokenizer files (weights/publish.py `copy_tokenizer`): in a
local run, where the tasks share one process, loading it again cost ~7 ms a task on the main recipe and about a second
for a real vocabulary. `load_tokenizer` keeps the last few it loaded, each under the contents of the files it was
loaded from (the tokenizer files, config.json) and the names of the directory's other files, so a directory whose
tokenizer differs in any byte loads its own. The tokenizer handed out is shared: callers use it and change nothing on it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from miles_core.recent import Recent
from miles_core.weights.publish import TOKENIZER_FILES

KEPT = 4  # tokenizers a process keeps, the most recently used
_loaded = Recent(KEPT)  # what each was loaded from (`_files_of`) -> the tokenizer


def _files_of(directory: Path) -> tuple:
    """What a tokenizer loaded from `directory` is made of: a digest of each tokenizer file and of config.json, and the
    names of the other files."""
    names = sorted(path.name for path in directory.iterdir() if path.is_file())
    read = [name for name in names if name in TOKENIZER_FILES or name == "config.json"]
    return tuple(names), tuple((name, hashlib.blake2b((directory / name).read_bytes(), digest_size=16).digest()) for name in read)


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(directory)`, or the same tokenizer this process loaded from identical files."""
    return _loaded.kept(_files_of(Path(directory)), lambda: AutoTokenizer.from_pretrained(str(directory)))
