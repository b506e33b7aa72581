"""The base model: a user's HF checkpoint (`model.path`) or the tiny one built from the model section.

Either way the result is an HF directory in the run's artifacts that every stage loads the same
way (`from_pretrained`): weights, config, tokenizer with its chat template, generation config.

* `fetch_base(cfg, out, download)`: a checkpoint named by `model.path` is brought in (an
  object-store URI through `download`, the task's file access; a local directory is copied);
  without a path the tiny model is built from the section.
* `admit(model_dir, train, rollout)`: the boundary check, run before any compute reads the weights: a whole
  checkpoint transformers can build (`weights.check.check_hf_dir`: what the torch trainer, the
  embedded engine and SGLang's transformers fallback all need), a tokenizer whose ids fit the
  embedding, an architecture the megatron converter supports when it trains and the SGLang servers it
  launches serve, and parallel sizes that divide the model's shape. Each refusal names the file and the key.
* `source.json` in the base directory records where the weights came from and their digest; the
  tracking run logs it, so every policy version traces back to the exact checkpoint it started from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from miles_core.config import ConfigError, ModelConfig, RolloutConfig, TrainConfig
from miles_core.config.model import URI_SCHEMES
from miles_core.config.rules import check_parallel_fit
from miles_core.rollout.engines.sglang_families import CPU_REFUSALS
from miles_core.storage import atomic_dir
from miles_core.weights.check import CheckpointError, check_hf_dir, json_object

SOURCE_FILE = "source.json"
_CHUNK = 8 << 20


def is_uri(path: str) -> bool:
    return path.startswith(URI_SCHEMES)


def checkpoint_digest(model_dir: str | Path) -> str:
    """sha256 over every file of the checkpoint (relative name and bytes, in name order), source.json excluded."""
    root, h = Path(model_dir), hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and p.name != SOURCE_FILE):
        h.update(file.relative_to(root).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def fetch_base(cfg: ModelConfig, out: str | Path, download: Callable[[str, str], None], key: str = "model.path") -> dict:
    """The base checkpoint at `out` (replaced atomically); returns its source record (also written to out/source.json).
    `key` names the config key the path came from in an error (the distillation teacher's is distill.teacher)."""
    with atomic_dir(out) as tmp:
        if not cfg.path:
            from miles_core.models.tiny import build_tiny_model  # imported where used: it loads torch and model classes

            build_tiny_model(cfg, str(tmp))
        elif is_uri(cfg.path):
            download(cfg.path, str(tmp))
        elif Path(cfg.path).is_dir():
            shutil.copytree(cfg.path, tmp, dirs_exist_ok=True)  # a copy, not links: the user may rewrite their files in place
        else:
            raise CheckpointError(f"{key}: {cfg.path} is no directory here (on a cluster, name an object-store URI: {', '.join(URI_SCHEMES[:3])} ...)")
        (tmp / SOURCE_FILE).unlink(missing_ok=True)  # a checkpoint that is itself a base artifact keeps its own origin out
        record = {"path": cfg.path or f"tiny:{cfg.arch}:seed={cfg.seed}", "sha256": checkpoint_digest(tmp)}
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2))
    return record


def read_source(model_dir: str | Path) -> dict:
    return json_object(Path(model_dir) / SOURCE_FILE, "the base model's source record")


def _text_part(config: dict) -> dict:
    """The causal LM's part of a config.json: a multimodal checkpoint keeps it under text_config."""
    return config.get("text_config") or config


# model section key -> the config.json keys that hold it, by family (the first one present counts)
SHAPE_KEYS = {
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "intermediate_size": ("intermediate_size",),
    "num_layers": ("num_hidden_layers",),
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
}


def model_shape(config: dict) -> dict[str, int]:
    """The sizes megatron splits over ranks that an HF config.json states (keys as in the model section); a size the
    family does not state (a dense model's experts) is left out, and no parallel size is checked against it."""
    text = _text_part(config)
    if "num_hidden_layers" not in text and isinstance(text.get("layers_block_type"), list):  # hybrid models list their layers
        text = {**text, "num_hidden_layers": len(text["layers_block_type"])}
    found = {key: next((text[k] for k in keys if isinstance(text.get(k), int) and text[k] > 0), None) for key, keys in SHAPE_KEYS.items()}
    return {key: value for key, value in found.items() if value is not None}


def _check_vocab(directory: Path, config: dict) -> None:
    from miles_core.models.tokenizers import load_tokenizer  # the tokenizer only after the files parsed (check_hf_dir)

    rows = _text_part(config).get("vocab_size")
    tokenizer = load_tokenizer(directory)
    if not isinstance(rows, int) or len(tokenizer) > rows:
        raise CheckpointError(
            f"{directory / 'config.json'}: key vocab_size: {rows!r} embedding rows, but the tokenizer has {len(tokenizer)} tokens "
            "(ids past the embedding would index out of range): the tokenizer does not belong to these weights"
        )


def _check_backend(directory: Path, config: dict, train: TrainConfig) -> None:
    """The megatron converter takes the family, and the backend trains it right in the recipe's parallel layout."""
    if train.backend != "megatron":  # the torch backend trains whatever transformers builds (check_hf_dir built it)
        return
    from miles_core.checkpoint.arch import layout_refusal
    from miles_core.checkpoint.hf_megatron import arch_spec

    try:
        spec = arch_spec(config, source=str(directory / "config.json"))
    except ValueError as err:
        raise CheckpointError(f"{err} (train.backend: megatron)") from None
    refused = layout_refusal(spec, train.tensor_parallel, train.expert_parallel)
    if refused:
        key, reason = refused
        raise ConfigError(f"{key}: {reason} ({directory / 'config.json'}, train.backend: megatron)")


def _check_engine(directory: Path, config: dict, rollout: RolloutConfig) -> None:
    """The SGLang servers the run launches can serve the family (on CPU, miles_core/rollout/engines/sglang_families.py)
    and split its attention heads over their tensor-parallel GPUs. Servers the run attaches to (`urls`) are the user's."""
    sglang = rollout.sglang
    if rollout.engine != "sglang" or sglang.urls:
        return
    kind = config.get("model_type")
    if sglang.device == "cpu" and kind in CPU_REFUSALS:
        raise CheckpointError(
            f"{directory / 'config.json'}: key model_type: {kind!r}: SGLang does not serve it on CPU (rollout.sglang.device: cpu): "
            f"{CPU_REFUSALS[kind][1]}. Roll out with rollout.engine: torch, or on GPUs"
        )
    heads = _text_part(config).get("num_attention_heads")
    if isinstance(heads, int) and heads % sglang.tensor_parallel:
        raise ConfigError(
            f"rollout.sglang.tensor_parallel: must divide {directory / 'config.json'}: num_attention_heads ({heads}): "
            f"each SGLang server splits the attention heads over its {sglang.tensor_parallel} GPUs"
        )


def admit(model_dir: str | Path, train: TrainConfig, rollout: RolloutConfig) -> None:
    """Raise CheckpointError (or ConfigError for parallel sizes) unless the run can train and serve this checkpoint."""
    directory = Path(model_dir)
    check_hf_dir(directory, tokenizer=True)
    config = json_object(directory / "config.json", "the model's config")
    _check_vocab(directory, config)
    _check_backend(directory, config, train)
    _check_engine(directory, config, rollout)
    check_parallel_fit(train, model_shape(config), where=f"{directory / 'config.json'}: ")
