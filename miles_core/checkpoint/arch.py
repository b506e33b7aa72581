"""What the megatron backend reads from an HF config.json: the ArchSpec of a family it maps, or why it refuses one.

`arch_spec(config)` gives the sizes and options the weight mapping (hf_megatron.py) and the model
builder (miles_core/train/megatron/arch_config.py) need, for the families megatron-core 0.16.1 builds
on its local layer spec here: Qwen2, Qwen3, Llama (dense GQA), Qwen3-MoE, DeepSeek-V3 (multi-latent
attention, shared experts, dense first layers, sigmoid routing with a correction bias, grouped top-k,
YaRN), Kimi-K2.5 (its DeepSeek-V3 text model; the vision tower is not trained), GLM-4.5 (GQA with
biased projections, half-rotary heads, optional q/k norms, DeepSeek-style experts) and GLM-4.7-Flash
(`glm4_moe_lite`: DeepSeek-V3's layers, its dense layers named by `mlp_layer_types`), and DeepSeek-V2
(MLA, queries with or without a low-rank projection, softmax-routed DeepSeek experts as transformers runs them)
and gpt-oss (learnt attention sinks, sliding-window layers alternating with full ones, biased q/k/v/o projections,
YaRN, biased experts with the clamped SwiGLU, a biased router softmaxed over its top-k logits).
`megatron_refusal(config)` gives every other family's reason in one sentence; `arch_spec` raises it
as a CheckpointError naming the file and the model_type, so a run is refused before any compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from miles_core.weights.check import CheckpointError

VOCAB_PAD_MULTIPLE = 128  # megatron's make_vocab_size_divisible_by default; divisible by any TP <= 128
ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k25", "glm4_moe", "glm4_moe_lite", "gpt_oss")  # config.json model_type
MLA_ARCHS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # multi-latent attention with DeepSeek-style experts
YARN_ARCHS = (*MLA_ARCHS, "gpt_oss")  # the families whose YaRN RoPE the conversion maps
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x), gpt-oss's swiglu_alpha
GPT_OSS_DEFAULTS = {"sliding_window": 128, "swiglu_limit": 7.0}  # transformers' GptOssConfig, for a config.json without them
SIGMOID_ARCHS = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")  # sigmoid routers with e_score_correction_bias
MULTIMODAL = {"kimi_k25": "deepseek_v3"}  # model_type -> the model_type of its text model, which is what is converted

_DSA = "DeepSeek sparse attention's lightning indexer is only an experimental megatron-core 0.16.1 variant that needs the fast_hadamard_transform CUDA kernels"
_GDN = (
    "megatron-core 0.16.1 has Gated DeltaNet linear attention only as an experimental variant that needs the flash-linear-attention and causal-conv1d kernels"
)
REFUSALS = {
    "deepseek_v32": f"{_DSA}, so its sparse attention cannot be built here",
    "glm_moe_dsa": f"{_DSA}, so GLM-5's sparse attention cannot be built here",
    "deepseek_v4": (
        "its compressed sparse attention, hyper-connections and hash-routed first MoE layer have no counterpart in megatron-core 0.16.1 "
        "(whose DeepSeek sparse attention is experimental and needs the fast_hadamard_transform CUDA kernels)"
    ),
    "glm5_next": (
        "its KDA linear-attention layers and hyper-connections have no counterpart in megatron-core 0.16.1, and its DeepSeek sparse attention "
        "indexer is only experimental there (fast_hadamard_transform CUDA kernels)"
    ),
    "qwen3_next": f"{_GDN}, which its hybrid layers are built from",
    "qwen3_5": f"{_GDN}, which its hybrid layers are built from",
    "qwen3_5_moe": f"{_GDN}, which its hybrid layers are built from",
    "nemotron_h": "its Mamba-2 layers need megatron-core's MambaModel, whose mixer runs only on the mamba-ssm and causal-conv1d CUDA kernels, not the GPT layers converted here",
    "minimax_m2": (
        "its q/k RMSNorm normalises all heads of a projection together (one norm over num_heads * head_dim), while megatron-core 0.16.1's "
        "qk_layernorm normalises each head on its own"
    ),
    "llama4": (
        "its chunked local attention (attention_chunk_size) and the attention temperature of its NoPE layers have no option in "
        "megatron-core 0.16.1's TransformerConfig"
    ),
}
# what megatron-core 0.16.1 trains wrong at tensor parallel > 1 (the rule of rules.py for the tiny models,
# `layout_refusal` at admission for a checkpoint)
MOE_TP_REASON = (
    "MoE layers at tensor parallel > 1 need expert parallel > 1: megatron-core 0.16.1 (expert tensor parallel 1) sums "
    "the gradients of experts kept whole on every rank over the data-parallel ranks only, yet each tensor-parallel rank's "
    "copy saw only its own part of the sequence"
)
for _kind, _text in (("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text"), ("llama4", "llama4_text"), ("glm5_next", "glm5_next_text")):
    REFUSALS[_text] = REFUSALS[_kind]


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention's low-rank projections and the split of each query/key head into a no-RoPE and a RoPE part."""

    q_lora_rank: int  # 0: queries projected directly (no low-rank query)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Yarn:
    """YaRN rotary scaling as HF's rope_parameters state it (mscale pair as megatron-core reads it)."""

    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    truncate: bool = True  # the correction range rounded to whole dimensions (HF's `truncate`)


@dataclass(frozen=True)
class ArchSpec:
    """What the mapping and the megatron model builder need from an HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_renormalize: bool = False  # top-k weights sum to 1 (Qwen3-MoE and DeepSeek norm_topk_prob)
    moe_sigmoid: bool = False  # DeepSeek/GLM routers: sigmoid scores, top-k chosen with e_score_correction_bias added
    moe_shared_ffn_hidden_size: int = 0  # width of the shared experts (0: none)
    moe_groups: int = 0  # group-limited routing: experts in this many groups, moe_group_top_k of them chosen (0: off)
    moe_group_top_k: int = 0
    moe_scaling: float = 1.0  # routed_scaling_factor
    dense_layers: tuple[int, ...] = ()  # the layers of an MoE model that keep a dense MLP (first_k_dense_replace, mlp_layer_types)
    rotary_fraction: float = 1.0  # partial_rotary_factor: RoPE on the first part of each head only
    mla: MLA | None = None
    yarn: Yarn | None = None
    linear_bias: bool = False  # biases on the output projection, the experts and the router (gpt-oss)
    attention_sinks: bool = False  # a learnt per-head logit in every softmax's denominator (gpt-oss `sinks`)
    sliding_window: int = 0  # the tokens a windowed layer's query sees, itself included (0: no window)
    windowed_layers: tuple[int, ...] = ()  # the layers that attend within sliding_window
    swiglu_limit: float = 0.0  # gpt-oss's SwiGLU: gate and up clamped to it, x * sigmoid(1.702 x) gate, up + 1 (0: plain SwiGLU)

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers


def text_config(config: dict) -> dict:
    """The part of a config.json that describes the converted causal LM (a multimodal checkpoint's text_config)."""
    return config.get("text_config") or config if config.get("model_type") in MULTIMODAL else config


def _rope(text: dict) -> dict:
    """RoPE settings as transformers 5 states them (`rope_parameters`) or as published configs do (`rope_scaling` with `type`)."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _value_refusal(kind: str, text: dict) -> str | None:
    """Why a mapped family's config asks for something megatron-core 0.16.1 computes differently, if it does."""
    rope, rotaries = _rope(text), ("default", "yarn") if kind in YARN_ARCHS else ("default",)
    if rope["rope_type"] not in rotaries:
        return f"rope_type {rope['rope_type']!r}: the conversion maps {' and '.join(rotaries)} RoPE for {kind}"
    if kind in MLA_ARCHS and rope["rope_type"] == "yarn" and rope.get("truncate") is False:
        return "YaRN with truncate false: megatron-core 0.16.1's multi-latent attention always rounds the correction range"
    if kind == "gpt_oss":
        return _gpt_oss_refusal(text)
    if kind in MLA_ARCHS and text.get("attention_bias"):
        return "attention_bias true: megatron-core 0.16.1 builds multi-latent attention's down and output projections without biases"
    if kind in MLA_ARCHS and text.get("rope_interleave") is False:
        return "rope_interleave false: megatron-core 0.16.1's multi-latent attention always de-interleaves the RoPE part of each head"
    top_k, groups, group_top_k = text.get("num_experts_per_tok", 1), text.get("n_group") or 1, text.get("topk_group") or 1
    if kind == "deepseek_v2":
        return _softmax_routing_refusal(text, top_k, groups, group_top_k)
    if kind not in SIGMOID_ARCHS:
        return None
    if top_k > 1 and not text.get("norm_topk_prob", True):
        return "norm_topk_prob false: megatron-core 0.16.1 always renormalises a sigmoid router's top-k weights"
    if 1 < groups and group_top_k < groups and top_k // group_top_k != 2:
        return f"grouped routing scores each group by its top-2 experts, megatron-core 0.16.1 by its top num_experts_per_tok // topk_group ({top_k // group_top_k})"
    return None


def _softmax_routing_refusal(text: dict, top_k: int, groups: int, group_top_k: int) -> str | None:
    """DeepSeek-V2's router as transformers runs it: softmax over all experts, greedy or group-limited top-k, no renormalisation."""
    if text.get("mlp_bias"):
        return "mlp_bias true: the conversion maps MLPs without biases"
    method = text.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        return f"topk_method {method!r}: transformers' DeepSeek-V2 routes greedy or group_limited_greedy only"
    if method == "group_limited_greedy" and 1 < groups and group_top_k < groups and top_k // group_top_k != 1:
        return f"group_limited_greedy scores each group by its best expert, megatron-core 0.16.1 by its top num_experts_per_tok // topk_group ({top_k // group_top_k})"
    return None


def _gpt_oss_refusal(text: dict) -> str | None:
    """gpt-oss settings that megatron-core 0.16.1's options cannot express, and its published MXFP4 weights."""
    if text.get("quantization_config"):
        method = text["quantization_config"].get("quant_method")
        return f"quantization_config ({method}): the conversion reads unquantized weights, so the checkpoint must be dequantized (bf16) first"
    if text.get("swiglu_alpha", QUICK_GELU_ALPHA) != QUICK_GELU_ALPHA:
        return f"swiglu_alpha {text['swiglu_alpha']}: megatron-core 0.16.1's quick_gelu fixes the gate's sigmoid scale at {QUICK_GELU_ALPHA}"
    if not text.get("attention_bias", True):
        return "attention_bias false: megatron-core 0.16.1's add_bias_linear gives the output projection a bias whenever the experts have one"
    return None


def megatron_refusal(config: dict) -> str | None:
    """Why the megatron backend cannot train this HF config (a dict as in config.json), in one sentence; None if it can."""
    kind = config.get("model_type")
    text_kind = text_config(config).get("model_type")
    if kind in REFUSALS or text_kind in REFUSALS:
        return REFUSALS.get(kind) or REFUSALS[text_kind]
    if kind not in ARCHS:
        return f"not a family the megatron conversion maps (it maps {', '.join(ARCHS)})"
    return _value_refusal(MULTIMODAL.get(kind, kind), text_config(config))


def _yarn(rope: dict) -> Yarn | None:
    if rope.get("rope_type") != "yarn":
        return None
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)  # HF uses the mscale ratio only when both are set, else 0.1 ln(factor) + 1
    beta_fast, beta_slow = rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0
    mscales = (mscale if both else 1.0, mscale_all_dim or 0.0)
    return Yarn(rope["factor"], rope["original_max_position_embeddings"], beta_fast, beta_slow, *mscales, truncate=rope.get("truncate", True))


def _deepseek_moe(text: dict, sigmoid: bool) -> dict:
    """DeepSeek-style experts: shared experts, dense first layers, sigmoid routing with a bias (DeepSeek-V3, GLM) or
    softmax routing, greedy or group-limited, never renormalised (DeepSeek-V2 as transformers runs it)."""
    grouped = sigmoid or text.get("topk_method") == "group_limited_greedy"
    groups = (text.get("n_group") or 1) if grouped else 1
    return dict(
        num_experts=text["n_routed_experts"],
        moe_top_k=text["num_experts_per_tok"],
        moe_ffn_hidden_size=text["moe_intermediate_size"],
        moe_renormalize=sigmoid and bool(text.get("norm_topk_prob", True)),
        moe_sigmoid=sigmoid,
        moe_shared_ffn_hidden_size=text["moe_intermediate_size"] * (text.get("n_shared_experts") or 0),
        moe_groups=groups if groups > 1 else 0,
        moe_group_top_k=text.get("topk_group") or 1 if groups > 1 else 0,
        moe_scaling=float(text.get("routed_scaling_factor") or 1.0),
        dense_layers=_dense_layers(text),
    )


def _dense_layers(text: dict) -> tuple[int, ...]:
    kinds = text.get("mlp_layer_types")
    if kinds is None and text.get("model_type") == "glm4_moe_lite":  # its config class's default: a dense first layer
        kinds = ["dense"] + ["sparse"] * (text["num_hidden_layers"] - 1)
    if kinds is not None:
        return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return tuple(range(text.get("first_k_dense_replace") or 0))


def _gpt_oss(text: dict) -> dict:
    """gpt-oss: biased attention with sinks, every `sliding_attention` layer windowed, biased experts (each of
    `intermediate_size`) behind a biased router whose top-k logits are softmaxed (renormalised top-k weights)."""
    # transformers' default for a config that names no layer_types: the even layers windowed
    kinds = text.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(text["num_hidden_layers"])]
    window = text.get("sliding_window", GPT_OSS_DEFAULTS["sliding_window"]) or 0
    return dict(
        qkv_bias=True,
        qk_norm=False,
        linear_bias=True,
        attention_sinks=True,
        sliding_window=window,
        windowed_layers=tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") if window else (),
        swiglu_limit=float(text.get("swiglu_limit", GPT_OSS_DEFAULTS["swiglu_limit"])),
        num_experts=text["num_local_experts"],
        moe_top_k=text["num_experts_per_tok"],
        moe_ffn_hidden_size=text["intermediate_size"],
        moe_renormalize=True,
    )


def _family_fields(kind: str, text: dict) -> dict:
    heads = text["num_attention_heads"]
    if kind in MLA_ARCHS:
        mla = MLA(text.get("q_lora_rank") or 0, text["kv_lora_rank"], text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"])
        return dict(
            num_kv_heads=heads,
            head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            qkv_bias=False,
            qk_norm=False,
            mla=mla,
            **_deepseek_moe(text, kind in SIGMOID_ARCHS),
        )
    if kind == "gpt_oss":
        return _gpt_oss(text)
    if kind == "glm4_moe":
        return dict(qkv_bias=bool(text.get("attention_bias")), qk_norm=bool(text.get("use_qk_norm")), **_deepseek_moe(text, sigmoid=True))
    moe = kind == "qwen3_moe"
    return dict(
        qkv_bias=kind == "qwen2" or bool(text.get("attention_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        num_experts=text.get("num_local_experts", text.get("num_experts", 0)) if moe else 0,
        moe_top_k=text.get("num_experts_per_tok", 0) if moe else 0,
        moe_ffn_hidden_size=text.get("moe_intermediate_size", 0) if moe else 0,
        moe_renormalize=bool(text.get("norm_topk_prob", False)),
    )


def arch_spec(hf_config: dict, source: str = "config.json") -> ArchSpec:
    """The ArchSpec of an HF config (a dict as in config.json); a family megatron cannot train fails here with its reason."""
    kind = hf_config.get("model_type")
    reason = megatron_refusal(hf_config)
    if reason:
        raise CheckpointError(f"{source}: model_type {kind!r} cannot train on the megatron backend: {reason}")
    text = text_config(hf_config)
    rope, heads = _rope(text), text["num_attention_heads"]
    fields = dict(
        model_type=kind,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        ffn_hidden_size=text["intermediate_size"],
        norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
        max_positions=text.get("max_position_embeddings", 4096),
        tied_embeddings=bool(text.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))),
        rotary_fraction=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
        yarn=_yarn(rope),
    )
    return ArchSpec(**{**fields, **_family_fields(MULTIMODAL.get(kind, kind), text)})


def layout_refusal(spec: ArchSpec, tensor_parallel: int, expert_parallel: int) -> tuple[str, str] | None:
    """(key, reason) when the megatron backend would train this checkpoint wrong in that parallel layout, else None."""
    if spec.num_experts and tensor_parallel > 1 and expert_parallel == 1:
        return "train.expert_parallel", MOE_TP_REASON
    return None
