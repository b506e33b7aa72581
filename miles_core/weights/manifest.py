"""The lineage manifest of a published policy version: `policy.json` beside its weights records the version, its
parent version, the checkpoint it came from and the sha256 of its weights, which the tracking step logs as the
version's lineage. An adapter's (train.lora: the adapter alone, in PEFT's format) names the format (`adapter`) and the
sha256 of the base model it applies to (`base_sha256`), which an engine checks before applying it.

Reading it needs no model stack: a tracking task's pod starts without torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from miles_core.storage import sha256_file
from miles_core.weights.check import CheckpointError, json_object


def weights_sha256(policy_dir: str | Path) -> str:
    """sha256 of the weights: of model.safetensors's bytes, or for a sharded checkpoint of its shards' sha256s in name order."""
    files = sorted(Path(policy_dir).glob("*.safetensors"))
    if len(files) == 1:
        return sha256_file(files[0])
    h = hashlib.sha256()
    for file in files:
        h.update(bytes.fromhex(sha256_file(file)))
    return h.hexdigest()


ADAPTER_FORMAT = "peft-lora"
MANIFEST_FILE = "policy.json"


def write_manifest(policy_dir: str | Path, version: int, parent_version: int | None, source: str, base_dir: str | None = None) -> dict:
    """policy.json of the version in policy_dir; an adapter's (base_dir: its base model) names its format and base."""
    manifest = {
        "version": version,
        "parent_version": parent_version,
        "source": source,
        "weights_sha256": weights_sha256(policy_dir),
    }
    if base_dir is not None:
        manifest.update(adapter=ADAPTER_FORMAT, base_sha256=weights_sha256(base_dir))
    (Path(policy_dir) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return manifest


MANIFEST_KEYS = {"version": (int,), "parent_version": (int, type(None)), "source": (str,), "weights_sha256": (str,)}
ADAPTER_MANIFEST_KEYS = {"adapter": (str,), "base_sha256": (str,)}  # an adapter's manifest only


def read_manifest(policy_dir: str | Path) -> dict:
    """policy.json of a published version, each key checked; CheckpointError naming the file and key."""
    path = Path(policy_dir) / MANIFEST_FILE
    manifest = json_object(path, "the policy manifest")
    keys = {**MANIFEST_KEYS, **(ADAPTER_MANIFEST_KEYS if "adapter" in manifest else {})}
    for key, kinds in keys.items():
        if key not in manifest:
            raise CheckpointError(f"{path}: key {key} missing")
        if not isinstance(manifest[key], kinds) or isinstance(manifest[key], bool):
            raise CheckpointError(f"{path}: key {key}: expected {' or '.join(k.__name__ for k in kinds)}, got {type(manifest[key]).__name__}")
    return manifest
