"""A multi-token-prediction (MTP) draft head beside a policy: DeepSeek-V3's MTP module, one depth.

At position t the head reads the policy's last hidden state h_t (after its final norm: the input of lm_head) and
the embedding of token t+1, normalises each (RMSNorm), projects their concatenation [enorm(emb); hnorm(h)] back to
the hidden size (`eh_proj`, the order of DeepSeek-V3's published checkpoints), runs one transformer block and hands
its output to the policy's own final norm and lm_head (shared, never copied) to predict token t+2.  Drafting
further, it reads its own output after that final norm as the next hidden state.  Those are the conventions of
SGLang's MTP drafts (it hands a Llama/Qwen-style target's normed hidden states to the draft, and its MiMo MTP
layer zeroes the embedding at position 0, as the head does), so the head converts exactly into one
(rollout/engines/sglang_draft.py).

Departures from DeepSeek-V3: the block is a small standard one (RMSNorm, multi-head causal attention with
RoPE, SwiGLU MLP) for every family, not the policy's own decoder layer, whose mask, rotary and cache plumbing
differ per family (MLA, linear attention, sliding windows, DSA indexers); and the head is always an added
module: transformers' modelling code defines no MTP layers for DeepSeek-V3 or GLM even where their configs
carry `num_nextn_predict_layers` (published MTP weights are dropped on load).  It is saved beside the policy as
`mtp/mtp.safetensors` + `mtp/mtp.json`; the torch engine drafts with it when it is present (rollout/speculative.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from miles_core.models import text_config

# in a folder of their own: tools that load every *.safetensors of a policy directory (SGLang, weights_sha256) skip it
MTP_DIR, MTP_WEIGHTS, MTP_CONFIG = "mtp", "mtp.safetensors", "mtp.json"


@dataclass(frozen=True)
class MtpShape:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def of_policy(cls, config) -> MtpShape:
        """The head's shape from the policy's (text) config: its hidden size and heads, a 3x-wide MLP."""
        text = text_config(config)
        hidden = text.hidden_size
        heads = text.num_attention_heads if hidden % text.num_attention_heads == 0 else 1
        eps = getattr(text, "rms_norm_eps", None) or 1e-6  # the policy's, so that one eps serves every norm of an SGLang draft
        return cls(hidden_size=hidden, num_heads=heads, intermediate_size=3 * hidden, rms_norm_eps=eps)


class HeadCache:
    """Keys and values of the head's attention [B, heads, S, d], grown per call and cropped on rejection."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (rotate-half) of x [B, heads, S, d] at positions [B, S]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)  # [d/2]
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, S, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MtpBlock(nn.Module):
    """Pre-norm block: causal multi-head attention with RoPE over the cached positions, then a SwiGLU MLP."""

    def __init__(self, shape: MtpShape):
        super().__init__()
        h = shape.hidden_size
        self.shape = shape
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=shape.rms_norm_eps), nn.RMSNorm(h, eps=shape.rms_norm_eps)
        self.qkv, self.out = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.gate_up, self.down = nn.Linear(h, 2 * shape.intermediate_size, bias=False), nn.Linear(shape.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: HeadCache | None) -> torch.Tensor:
        """x [B, S, H] at positions [B, S]; key_mask [B, cached + S] (0 on left padding) -> [B, S, H]."""
        B, S, H = x.shape
        heads = self.shape.num_heads
        q, k, v = self.qkv(self.attn_norm(x)).view(B, S, 3, heads, H // heads).permute(2, 0, 3, 1, 4)  # each [B, heads, S, d]
        q, k = _rotate(q, positions, self.shape.rope_theta), _rotate(k, positions, self.shape.rope_theta)
        if cache is not None:
            k, v = cache.extend(k, v)
        past = k.shape[2] - S
        causal = torch.ones(S, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=past)  # [S, K]
        visible = causal & key_mask[:, None, None, :].bool()  # [B, 1, S, K]
        visible = visible | _diagonal(S, k.shape[2], past, x.device)  # a left-pad query sees itself (no empty softmax row)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)  # [B, heads, S, d]
        x = x + self.out(attended.transpose(1, 2).reshape(B, S, H))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _diagonal(queries: int, keys: int, past: int, device: torch.device) -> torch.Tensor:
    """[Q, K] true where query i meets its own key (past + i)."""
    return torch.arange(keys, device=device)[None, :] == (past + torch.arange(queries, device=device))[:, None]


class MtpHead(nn.Module):
    """The draft head: forward(hidden, next_embeds, ...) -> the block's output g; the policy's final norm and lm_head
    turn g into the logits of the token after next (`draft_logits`)."""

    def __init__(self, shape: MtpShape):
        super().__init__()
        self.shape = shape
        self.enorm, self.hnorm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps), nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=False)
        self.block = MtpBlock(shape)

    def forward(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache: HeadCache | None = None
    ) -> torch.Tensor:
        """hidden: policy hidden states h_t [B, S, H] (after its final norm); next_embeds: embeddings of tokens t+1
        [B, S, H], zeroed at position 0; positions [B, S]; key_mask [B, cached + S] -> g [B, S, H], predicting tokens
        t+2 through `draft_logits`."""
        next_embeds = next_embeds.masked_fill(positions[..., None] == 0, 0.0)
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return self.block(x, positions, key_mask, cache)


def final_norm(model: nn.Module) -> nn.Module:
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no final norm at get_decoder().norm: an MTP head needs it to share the policy's output layer")
    return norm


def draft_hidden(model: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """The policy's final norm applied to the head's output g [..., H] (lm_head's input, which the head chains as its
    next hidden state), the norm's weights outside any graph: the head's loss never reaches the policy's parameters."""
    norm = final_norm(model)
    return torch.func.functional_call(norm, {name: p.detach() for name, p in norm.named_parameters()}, (g,))


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The policy's lm_head on normed hidden states [..., H], its weights outside any graph."""
    lm_head = model.get_output_embeddings()
    return F.linear(hidden, lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach())


def draft_logits(model: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """The policy's final norm and lm_head applied to the head's output g [..., H]."""
    return head_logits(model, draft_hidden(model, g))


class HiddenTap:
    """Captures the policy's last hidden states (the output of its final norm) on every forward pass."""

    def __init__(self, model: nn.Module):
        self.hidden: torch.Tensor | None = None
        self.handle = final_norm(model).register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.hidden = output

    def take(self) -> torch.Tensor:
        hidden, self.hidden = self.hidden, None
        return hidden

    def remove(self) -> None:
        self.handle.remove()


def build_head(policy_config, seed: int = 0) -> MtpHead:
    """A fresh head for a policy (small normal init, from `seed`, the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = MtpHead(MtpShape.of_policy(policy_config))
        for linear in (m for m in head.modules() if isinstance(m, nn.Linear)):
            nn.init.normal_(linear.weight, std=0.02)
    return head


def save_head(head: MtpHead, policy_dir: str | Path) -> None:
    """The head into `policy_dir`/mtp/ (weights + shape)."""
    directory = Path(policy_dir) / MTP_DIR
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(directory / MTP_WEIGHTS))
    (directory / MTP_CONFIG).write_text(json.dumps(asdict(head.shape)))


def has_head(policy_dir: str | Path) -> bool:
    return (Path(policy_dir) / MTP_DIR / MTP_CONFIG).exists()


def load_head(policy_dir: str | Path, dtype: torch.dtype = torch.float32) -> MtpHead:
    directory = Path(policy_dir) / MTP_DIR
    head = MtpHead(MtpShape(**json.loads((directory / MTP_CONFIG).read_text())))
    head.load_state_dict(load_file(str(directory / MTP_WEIGHTS)))
    return head.to(dtype)
