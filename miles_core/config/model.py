"""model: the base policy: a user's HF checkpoint (path), or the tiny one built from the architecture and size."""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.config.base import check as _check
from miles_core.config.base import check_finite

FIRST_ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")  # the main recipes' tiny builds
# the frontier families of miles_core/models/families.py, each at tiny size with its own transformers config class
FAMILY_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k25")
FAMILY_ARCHS += ("glm4_moe", "glm_moe_dsa", "glm5_next", "llama4", "gpt_oss", "minimax_m2", "nemotron_h")
MODEL_ARCHS = FIRST_ARCHS + FAMILY_ARCHS
DENSE_ARCHS = ("qwen2", "qwen3", "llama", "qwen3_5")  # every other arch has MoE layers (experts to split over ranks)
# layers a family needs to hold each of its layer kinds (dense + MoE, linear + full attention, sliding + compressed ...)
MIN_LAYERS = {"deepseek_v4": 3, "nemotron_h": 3, "glm5_next": 4, "llama4": 4}
MIN_LAYERS |= dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "deepseek_v32", "kimi_k25", "glm4_moe", "glm_moe_dsa", "gpt_oss"), 2)
URI_SCHEMES = ("s3://", "gs://", "gcs://", "abfs://", "abfss://", "az://", "oci://", "file://")  # what flytekit's file access reads


def check_checkpoint_path(path: str, key: str) -> None:
    """An HF checkpoint's path as `key` names it: a directory or an object-store URI of a scheme flytekit reads ("" allowed)."""
    _check(
        len(path) <= 4096 and path.isprintable() and path == path.strip(),
        key,
        f"must be a directory or an object-store URI (printable, no surrounding spaces), got {path[:80]!r}",
    )
    _check("://" not in path or path.startswith(URI_SCHEMES), key, f"unknown scheme in {path[:80]!r} (known: {', '.join(URI_SCHEMES)})")


@dataclass(frozen=True)
class ModelConfig:
    """The base policy. `path` names a user's HF checkpoint (its weights, tokenizer, chat template and
    generation config are used as they are); without it the tiny policy is built from the fields below
    and a seed (standard HF architecture, local tokenizer), which a path makes unused."""

    path: str = ""  # an HF checkpoint: a local directory, or an object-store URI (s3://, gs://, abfs://) the task downloads
    arch: str = "qwen2"  # one of MODEL_ARCHS
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    seed: int = 0
    num_experts: int = 8  # MoE families: routed experts per MoE layer
    moe_top_k: int = 2  # MoE families: experts per token
    moe_intermediate_size: int = 64  # MoE families: each expert's FFN width

    def __post_init__(self):
        check_finite(self, "model")
        check_checkpoint_path(self.path, "model.path")
        _check(self.arch in MODEL_ARCHS, "model.arch", f"must be one of {', '.join(MODEL_ARCHS)}, got {self.arch!r}")
        _check(self.num_experts >= 2 and self.moe_intermediate_size > 0, "model.num_experts", "need num_experts >= 2 and moe_intermediate_size > 0")
        _check(1 <= self.moe_top_k <= self.num_experts, "model.moe_top_k", f"must be in [1, num_experts={self.num_experts}]")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _check(getattr(self, name) > 0, f"model.{name}", "must be > 0")
        _check(self.hidden_size % self.num_heads == 0, "model.hidden_size", "must be divisible by num_heads")
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", "must divide num_heads")
        _check(self.seed >= 0, "model.seed", "must be >= 0")
        self._check_family()

    def _check_family(self) -> None:
        if self.arch not in FAMILY_ARCHS:
            return
        need = MIN_LAYERS.get(self.arch, 1)
        _check(
            self.num_layers >= need, "model.num_layers", f"arch {self.arch} needs at least {need} layers to hold each of its layer kinds, got {self.num_layers}"
        )
        head_dim = self.hidden_size // self.num_heads
        _check(head_dim % 8 == 0, "model.hidden_size", f"arch {self.arch} needs hidden_size / num_heads divisible by 8 (its rotary slices), got {head_dim}")
