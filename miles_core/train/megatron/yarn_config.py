"""YaRN's settings as megatron-core 0.16.1 names them, and the config that carries them for grouped-query attention.

MLATransformerConfig declares YaRN's settings (MLA applies its RoPE itself).  GPTModel with position_embedding_type
"yarn" (gpt-oss) reads the same settings with a `yarn_` prefix, with getattr, from a config that TransformerConfig
does not declare them on, and the attention computes its concentration factor from them: YarnTransformerConfig
declares them.  Imported only by the megatron backend (arch_config), where such a model is built.
"""

from __future__ import annotations

from dataclasses import make_dataclass

from megatron.core.transformer import TransformerConfig  # the optional backend's own class

from miles_core.checkpoint.arch import Yarn

# megatron-core's name of each YaRN setting -> the Yarn field it is
MLA_SETTINGS = {
    "rotary_scaling_factor": "factor",
    "original_max_position_embeddings": "original_max_positions",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}
GQA_SETTINGS = {f"yarn_{name}": field for name, field in MLA_SETTINGS.items()} | {"yarn_correction_range_round_to_int": "truncate"}

YarnTransformerConfig = make_dataclass(
    "YarnTransformerConfig", [(name, float | bool | None, None) for name in GQA_SETTINGS], bases=(TransformerConfig,), namespace={"__module__": __name__}
)


def yarn_fields(yarn: Yarn, settings: dict[str, str]) -> dict:
    """The config fields of `settings` (MLA_SETTINGS or GQA_SETTINGS) with the values of `yarn`."""
    return {name: getattr(yarn, field) for name, field in settings.items()}
