"""What a process reads once per checkpoint files, anew for any other: a directory's tokenizer (miles_core/models/tokenizers.py)
and its vocabulary size (miles_core.models.vocab_size)."""

import json
import shutil

import transformers

import miles_core.models
from miles_core.config import ModelConfig
from miles_core.models import tokenizers, vocab_size
from miles_core.models.tiny import build_tiny_model
from miles_core.models.tokenizers import load_tokenizer
from miles_core.recent import Recent


def test_the_same_tokenizer_files_load_once_and_a_changed_byte_loads_anew(tmp_path, monkeypatch):
    base = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), str(tmp_path / "base"))
    loads = []
    monkeypatch.setattr(tokenizers.AutoTokenizer, "from_pretrained", lambda d, _load=tokenizers.AutoTokenizer.from_pretrained: loads.append(d) or _load(d))
    monkeypatch.setattr(tokenizers, "_loaded", Recent(tokenizers.KEPT))
    first = load_tokenizer(base)
    copy = shutil.copytree(base, tmp_path / "next-version")  # what every checkpoint and policy of a run carries
    assert load_tokenizer(copy) is first and loads == [base]

    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    changed = load_tokenizer(copy)
    assert changed is not first and changed.model_max_length == 77 and first.model_max_length != 77
    (copy / "notes.txt").write_text("a file beside it")  # another file in the directory: loaded anew, not guessed the same
    assert load_tokenizer(copy) is not changed and len(loads) == 3

    for i in range(tokenizers.KEPT):  # the least recently used is dropped past KEPT
        other = shutil.copytree(base, tmp_path / f"other-{i}")
        (other / f"extra-{i}.txt").write_text("")
        load_tokenizer(other)
    assert load_tokenizer(base) is not first and len(loads) == 4 + tokenizers.KEPT


def test_the_vocabulary_of_the_same_config_is_read_once_and_another_config_its_own(tmp_path, monkeypatch):
    base = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), str(tmp_path / "base"))
    reads = []
    real = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda d: reads.append(d) or real(d))
    monkeypatch.setattr(miles_core.models, "_vocabularies", Recent(16))
    rows = vocab_size(base)
    copy = shutil.copytree(base, tmp_path / "next-version")
    assert vocab_size(str(copy)) == rows and reads == [base]
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": rows + 64}))
    assert vocab_size(str(copy)) == rows + 64 and len(reads) == 2
