"""The MTP head converted into SGLang's MiMo MTP draft model (rollout/engines/sglang_draft.py).

SGLang's own MiMoMTP cannot run here: its speculative workers need a GPU attention backend (docs/speculative.md).
The converted directory is therefore run the way SGLang's MiMoMTP reads and computes it (sglang/srt/models/
mimo_mtp.py in 0.5.23): the tensors by the names its load_weights maps, the embedding zeroed at position 0,
`input_proj([hidden_layernorm(h); token_layernorm(emb)])`, one Qwen2 decoder layer (transformers' own, the layer
SGLang's class mirrors), `final_layernorm`, the target's lm_head; and its normed output fed back as the next
hidden state. Its predictions must equal the head's.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from miles_core.config import ConfigError, RolloutConfig, SGLangConfig
from miles_core.models.mtp import HiddenTap, MtpHead, MtpShape, build_head, draft_hidden, draft_logits, save_head
from miles_core.rollout.engines.sglang_draft import DRAFT_ARCHITECTURE, PREFIX, speculative_launch_args, write_draft


def tiny_policy(path, rms_norm_eps=1e-6):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, rms_norm_eps=rms_norm_eps
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # a final norm that is not the identity: its copy must matter
    model.save_pretrained(path)
    return model


class MiMoMtpAsRead(nn.Module):
    """SGLang's MiMoMTP over a converted directory, computed with transformers' Qwen2 pieces."""

    def __init__(self, draft_dir, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        config = Qwen2Config(**{k: v for k, v in json.loads((draft_dir / "config.json").read_text()).items() if k != "architectures"})
        config._attn_implementation = "eager"
        state = {k.removeprefix(PREFIX): v for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm, self.hidden_layernorm, self.final_layernorm = Qwen2RMSNorm(h, eps), Qwen2RMSNorm(h, eps), Qwen2RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.mtp_block, self.rotary = Qwen2DecoderLayer(config, layer_idx=0), Qwen2RotaryEmbedding(config)
        top = {k: state.pop(k) for k in [k for k in state if k.split(".")[0] in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_proj")]}
        self.load_state_dict({**top, **{f"mtp_block.{k}": v for k, v in state.items()}}, strict=False)
        self.embed, self.lm_head = embed, lm_head

    def forward(self, hidden, tokens, positions):
        """hidden [1, S, H] (the target's, after its final norm), tokens [1, S] (one ahead), positions [1, S] -> normed [1, S, H]."""
        emb = self.embed(tokens).masked_fill((positions == 0)[..., None], 0.0)
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(emb)], dim=-1))
        S = x.shape[1]
        causal = torch.full((S, S), float("-inf")).triu(1)[None, None]
        x = self.mtp_block(x, attention_mask=causal, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.final_layernorm(x[0] if isinstance(x, tuple) else x)


def test_converted_draft_predicts_what_the_head_predicts(tmp_path):
    policy = tiny_policy(tmp_path)
    head = build_head(policy.config, seed=3)
    with torch.no_grad():
        for norm in (head.enorm, head.hnorm, head.block.attn_norm, head.block.mlp_norm):
            norm.weight.uniform_(0.5, 1.5)
    save_head(head, tmp_path)
    draft_dir = write_draft(tmp_path, tmp_path / "draft")
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == [DRAFT_ARCHITECTURE] and config["num_hidden_layers"] == 1
    draft = MiMoMtpAsRead(draft_dir, policy.get_input_embeddings(), policy.get_output_embeddings())

    tokens = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    tap = HiddenTap(policy)
    with torch.no_grad():
        policy(input_ids=tokens)
        hidden, positions = tap.take()[:, :-1], torch.arange(11)[None]  # h_t with token t+1, at position t
        tap.remove()
        ours = head(hidden, policy.get_input_embeddings()(tokens[:, 1:]), positions, torch.ones(1, 11))
        theirs = draft(hidden, tokens[:, 1:], positions)
        torch.testing.assert_close(theirs, draft_hidden(policy, ours), atol=1e-5, rtol=1e-5)
        assert torch.equal(policy.lm_head(theirs).argmax(-1), draft_logits(policy, ours).argmax(-1))
        # the next draft step reads the previous step's normed output as its hidden state, in both
        chained, next_token = draft_hidden(policy, ours[:, -1:]), draft_logits(policy, ours[:, -1:]).argmax(-1)
        hidden_2, tokens_2, positions_2 = torch.cat([hidden, chained], 1), torch.cat([tokens[:, 1:], next_token], 1), torch.arange(12)[None]
        ours_2 = head(hidden_2, policy.get_input_embeddings()(tokens_2), positions_2, torch.ones(1, 12))
        theirs_2 = draft(hidden_2, tokens_2, positions_2)
        torch.testing.assert_close(theirs_2[:, -1], draft_hidden(policy, ours_2[:, -1]), atol=1e-5, rtol=1e-5)


def test_a_policy_without_a_head_gets_a_fresh_draft_and_mismatched_norms_are_refused(tmp_path):
    tiny_policy(tmp_path / "plain")
    assert (write_draft(tmp_path / "plain", tmp_path / "draft") / "model.safetensors").exists()
    policy = tiny_policy(tmp_path / "eps", rms_norm_eps=1e-5)
    save_head(MtpHead(dataclasses.replace(MtpShape.of_policy(policy.config), rms_norm_eps=1e-6)), tmp_path / "eps")
    with pytest.raises(ValueError, match="eps 1e-06, the policy's final norm 1e-05"):
        write_draft(tmp_path / "eps", tmp_path / "draft-eps")


def test_launch_args_draft_one_chain_of_the_configured_length():
    assert speculative_launch_args("/d", 3) == [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"routing_replay": True}, "not with rollout.routing_replay"),
        ({"sglang": SGLangConfig(weight_sync="distributed")}, "with SGLang needs rollout.sglang.weight_sync: disk"),
        ({"sglang": SGLangConfig(extra_args="--speculative-algorithm NEXTN")}, "sets SGLang's --speculative-\\* flags itself"),
    ],
)
def test_speculative_sglang_settings_are_checked(fields, message):
    assert RolloutConfig(engine="sglang", speculative_tokens=2).speculative_tokens == 2
    with pytest.raises(ConfigError, match=f"rollout.speculative_tokens: {message}"):
        RolloutConfig(engine="sglang", speculative_tokens=2, **fields)
