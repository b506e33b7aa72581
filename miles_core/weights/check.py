"""The boundary check of an HF weight directory (a user's checkpoint, a published policy version),
run before any compute loads it: config.json is a JSON object transformers knows, every weight file
is a whole safetensors file, every tensor the model declares is there with its shape and a floating
dtype, and the tokenizer files (when asked for) parse.  The tensors are those that
`miles_core.models.loading.load_causal_lm` reads, named as `save_pretrained` writes them (per-expert MoE
tensors, original prefixes): a multimodal checkpoint is checked for its language model.  Each refusal
is one short CheckpointError naming the file and the key or tensor; transformers' own errors would
come later, longer, or never (a missing tensor is silently initialised at random)."""

from __future__ import annotations

import json
from pathlib import Path

MAX_JSON_BYTES = 64 << 20  # config and tokenizer files; real tokenizer.json files are up to ~30 MB
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
ECHO_CHARS = 80


class CheckpointError(ValueError):
    """A weight directory is malformed; the message names the file and the key or tensor."""


def _clip(text: str) -> str:
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 3] + "..."


def json_object(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({what})")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes, more than {MAX_JSON_BYTES}")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _expected_tensors(directory: Path, config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the causal LM of config.json reads, as save_pretrained names them (for a
    multimodal checkpoint: its language model's), built on the meta device (no memory)."""
    from transformers import AutoConfig  # the model skeleton; a directory that fails earlier checks never needs it

    from miles_core.models.loading import expected_tensors

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{directory / 'config.json'}: key model_type: expected a name, got {_clip(repr(model_type))}")
    try:
        return expected_tensors(AutoConfig.from_pretrained(directory))
    except Exception as err:  # noqa: BLE001 - transformers and huggingface_hub raise many unrelated types for a config they cannot build
        reason = _clip(str(err).splitlines()[0] if str(err) else type(err).__name__)
        raise CheckpointError(f"{directory / 'config.json'}: transformers cannot build a model from it ({reason})") from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of an HF directory: the shards its index names, or model.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json_object(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: key weight_map: expected an object of tensor name -> file name")
        names = sorted(set(weight_map.values()))
        if any(Path(n).name != n for n in names):
            raise CheckpointError(f"{index}: key weight_map: shard names must be plain file names, got {_clip(repr(names))}")
        return [directory / n for n in names]
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    raise CheckpointError(f"{directory}: no model.safetensors (nor model.safetensors.index.json)")


def _read_tensors(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of a whole safetensors file (header and data lengths checked)."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise CheckpointError(f"{file}: missing (a weight shard)")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}  # noqa: SIM118 - safe_open is no mapping
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{file}: not a whole safetensors file ({_clip(str(err))})") from None


def _int4_as_restored(found: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """An int4 weight (weights/int4.py: `<name>_packed` int32 [out, in / 8] beside `<name>_scale`) as the weight
    `load_causal_lm` restores from it: `<name>` [out, in] in its scale's dtype."""
    for packed in [n for n in found if n.endswith("_packed") and n.removesuffix("_packed") + "_scale" in found]:
        (out, words), _ = found.pop(packed)
        weight = packed.removesuffix("_packed")
        found[weight] = ((out, words * 8), found[weight + "_scale"][1])  # eight 4-bit values a word
    return found


def check_hf_dir(path: str | Path, tokenizer: bool = True) -> None:
    """Raise CheckpointError unless `path` is an HF weight directory `load_causal_lm` can load (text or multimodal)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (an HF weight directory was expected)")
    config = json_object(directory / "config.json", "the model's config")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in weight_files(directory):
        found.update(_read_tensors(file))
    found = _int4_as_restored(found)
    for name, shape in _expected_tensors(directory, config).items():
        if name not in found:
            raise CheckpointError(f"{directory}: tensor {name} missing from the weight files")
        got, dtype = found[name]
        if got != shape:
            raise CheckpointError(f"{directory}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{directory}: tensor {name} has dtype {dtype}, expected a floating type")
    if tokenizer:
        _check_tokenizer(directory)


def _check_tokenizer(directory: Path) -> None:
    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise CheckpointError(f"{directory}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (directory / name).exists():
            json_object(directory / name, "tokenizer")
