"""The policy's MTP draft head as an SGLang draft model, so that SGLang servers decode speculatively with it.

SGLang 0.5.23's MiMo MTP layer (`MiMoMTP`, sglang/srt/models/mimo_mtp.py) is the head of models/mtp.py exactly:
`input_proj([hidden_layernorm(h); token_layernorm(emb)])`, the embedding zeroed at position 0, one Qwen2 decoder
layer, `final_layernorm`, then the target's lm_head (SGLang's EAGLE worker hands the draft the target's embedding
and lm_head, and the target's hidden states after its final norm). SGLang drafts further by feeding the draft its
own normed output, as rollout/speculative.py does. The conversion:

| head (mtp/mtp.safetensors) | MiMoMTP (`model.mtp_layers.0.` + ...) |
|---|---|
| enorm, hnorm | token_layernorm, hidden_layernorm |
| eh_proj over [emb; h] | input_proj over [h; emb]: the two column halves swapped |
| block.attn_norm, block.mlp_norm | input_layernorm, post_attention_layernorm |
| block.qkv (no bias) | self_attn.q_proj / k_proj / v_proj, zero biases (Qwen2's attention has them) |
| block.out, block.gate_up, block.down | self_attn.o_proj, mlp.gate_proj + up_proj, mlp.down_proj |
| the policy's final norm (shared) | final_layernorm (a copy, written again with every version) |

MiMoMTP has one rms_norm_eps for all its norms, so the head's must equal the policy's, and the policy's final norm
must be a plain RMSNorm (x / rms(x) * w; Gemma's (1 + w) is not): both are checked. The directory is a draft
model for `--speculative-algorithm EAGLE --speculative-draft-model-path`; SGLang's `update_weights_from_disk` loads
one directory into the target and the draft alike (each skips the other's names), so a version is published into
the draft by a second update from this directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from miles_core.models import is_multimodal, text_config
from miles_core.models.mtp import MtpHead, build_head, final_norm, has_head, load_head

DRAFT_ARCHITECTURE = "MiMoMTP"  # SGLang's model class of the draft (registered by sglang/srt/models/mimo_mtp.py)
PREFIX = "model.mtp_layers.0."  # the names MiMoMTP.load_weights maps onto its layer


def draft_tensors(head: MtpHead, final_norm_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The head's weights (and a copy of the policy's final norm) under the names SGLang's MiMoMTP loads."""
    hidden, block = head.shape.hidden_size, head.block
    q, k, v = block.qkv.weight.chunk(3, dim=0)  # rows [q; k; v], as MtpBlock splits them
    gate, up = block.gate_up.weight.chunk(2, dim=0)
    emb_cols, hidden_cols = head.eh_proj.weight.split(hidden, dim=1)
    tensors = {
        "token_layernorm.weight": head.enorm.weight,
        "hidden_layernorm.weight": head.hnorm.weight,
        "input_proj.weight": torch.cat([hidden_cols, emb_cols], dim=1),
        "input_layernorm.weight": block.attn_norm.weight,
        "post_attention_layernorm.weight": block.mlp_norm.weight,
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": v,
        **{f"self_attn.{name}_proj.bias": torch.zeros(hidden) for name in "qkv"},
        "self_attn.o_proj.weight": block.out.weight,
        "mlp.gate_proj.weight": gate,
        "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": block.down.weight,
        "final_layernorm.weight": final_norm_weight,
    }
    return {PREFIX + name: t.detach().float().contiguous() for name, t in tensors.items()}


def draft_config(head: MtpHead, policy_config) -> Qwen2Config:
    """The draft's config: one Qwen2 layer of the head's shape (full multi-head attention), the policy's vocabulary."""
    text, shape = text_config(policy_config), head.shape
    config = Qwen2Config(
        vocab_size=text.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
    )
    config.architectures = [DRAFT_ARCHITECTURE]
    return config


def policy_final_norm(policy_dir: str | Path, policy_config) -> torch.Tensor:
    """The weight of the policy's final norm, read alone from its checkpoint (the model is built on the meta device
    only to find the norm's name); refused unless the norm is a plain RMSNorm with the config's rms_norm_eps."""
    if is_multimodal(policy_config):
        raise ValueError(f"{policy_dir}: a multimodal policy: its SGLang MTP draft is supported for text models only")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(policy_config)
    norm = final_norm(model)
    name = next(n for n, m in model.named_modules() if m is norm) + ".weight"
    weight = _read_tensor(Path(policy_dir), name).float()
    eps = getattr(policy_config, "rms_norm_eps", None)
    norm = norm.to_empty(device="cpu").float()
    norm.weight.data.copy_(weight)
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
    if eps is None or not torch.allclose(norm(x), F.rms_norm(x, weight.shape, weight, eps), atol=1e-5):
        raise ValueError(
            f"{policy_dir}: the final norm ({type(norm).__name__}) is not a plain RMSNorm with rms_norm_eps={eps}: "
            "SGLang's MiMo MTP draft could not reproduce it"
        )
    return weight


def _read_tensor(directory: Path, name: str) -> torch.Tensor:
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __contains__
                return f.get_tensor(name)
    raise ValueError(f"{directory}: no tensor {name} in its *.safetensors")


def write_draft(policy_dir: str | Path, out_dir: str | Path) -> Path:
    """The SGLang draft model of `policy_dir` in `out_dir` (config.json + model.safetensors, replaced): its MTP head,
    or a fresh one (seed 0) when it has none, so that the servers always have a draft to load."""
    policy_config = AutoConfig.from_pretrained(policy_dir)
    head = load_head(policy_dir) if has_head(policy_dir) else build_head(policy_config)
    weight = policy_final_norm(policy_dir, policy_config)
    if head.shape.rms_norm_eps != policy_config.rms_norm_eps:
        raise ValueError(
            f"{policy_dir}: the MTP head's norms use eps {head.shape.rms_norm_eps}, the policy's final norm "
            f"{policy_config.rms_norm_eps}: SGLang's MiMo MTP draft has one eps for both"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(draft_tensors(head, weight), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(draft_config(head, policy_config).to_dict(), indent=2))
    return out


def speculative_launch_args(draft_dir: str | Path, tokens: int) -> list[str]:
    """SGLang's flags for speculative decoding with the draft of `draft_dir`: one chain (top-k 1) of `tokens` drafts,
    verified with the token before them (`tokens` + 1 draft tokens), as the embedded engine drafts."""
    return [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        str(draft_dir),
        "--speculative-num-steps",
        str(tokens),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(tokens + 1),
    ]
