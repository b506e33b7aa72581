"""Each family end to end on the torch path: the embedded engine rolls out under the family's chat
template, the trainer's log-probs of those tokens equal the engine's, one RL step changes the weights,
and the published policy loads with `from_pretrained`.  A mixture-of-experts family records its routing in rollout and
the trainer replays it (R3): every family's routers take the recorded experts, and other experts change its log-probs.

Log-prob parity is checked in fp32 to an absolute 1e-5 per token: the engine decodes left-padded
batches step by step with a cache, the trainer runs one right-padded forward pass, so only summation
order differs (measured here: at most 1e-6 for every family over three seeds).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers

from miles_core.config import AlgoConfig, RolloutConfig, TrainConfig
from miles_core.config.model import DENSE_ARCHS
from miles_core.data.source import Prompt
from miles_core.models import is_multimodal
from miles_core.rollout.engines import make_engine
from miles_core.routing import moe_sizes
from miles_core.step import bind, generate, sampling_params, train_step
from miles_core.train import prefix
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.check import check_hf_dir
from miles_core.weights.publish import publish
from tests.families.conftest import FAMILIES

pytestmark = pytest.mark.families

PARITY_ATOL = 1e-5  # fp32, per token
# the families whose every layer is global softmax attention: a group's prompt is computed once in the trainer's passes
PACKED_ARCHS = ("qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "glm4_moe", "minimax_m2")
# prompts of three lengths, so the engine's batch is left-padded
PROMPTS = [Prompt("a", "1+1=", "2"), Prompt("b", "What is 47+85? Think step by step.", "132"), Prompt("c", "Compute (12-7)*3.", "15")]
ROLLOUT = RolloutConfig(n_samples=2, max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def rollout(family_dir, family_tokenizer):
    """arch -> the samples of one rollout of PROMPTS with the embedded engine (n=2, 8 new tokens)."""
    done = {}

    def get(arch: str):
        if arch not in done:
            config = transformers.AutoConfig.from_pretrained(family_dir(arch)).get_text_config(decoder=True)
            engine = make_engine(dataclasses.replace(ROLLOUT, routing_replay=moe_sizes(config) != (0, 0)), family_dir(arch), 0)
            tokenizer = family_tokenizer(arch)
            samples, _ = generate(engine, PROMPTS, tokenizer, sampling_params(ROLLOUT, tokenizer, seed=7))
            for s in samples:
                s.reward = float(s.index == 0)  # each group: one rewarded sample, one not
            done[arch] = samples
        return done[arch]

    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_engine_rolls_out_tokens_and_logprobs_under_the_template(arch, rollout, family_tokenizer):
    samples, tokenizer = rollout(arch), family_tokenizer(arch)
    assert len(samples) == len(PROMPTS) * ROLLOUT.n_samples
    texts = {p.id: p.text for p in PROMPTS}
    for s in samples:
        assert 1 <= len(s.response_tokens) == len(s.rollout_logprobs) <= ROLLOUT.max_new_tokens
        assert all(0 <= t < len(tokenizer) for t in s.response_tokens)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_logprobs)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": texts[s.prompt_id]}], tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(s.prompt_tokens) == rendered  # the family's prompt, token for token


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_trainer_logprobs_of_the_rollout_equal_the_engines(arch, rollout, family_dir, family_tokenizer):
    samples = rollout(arch)
    trainer = TorchTrainer.from_hf(family_dir(arch), TrainConfig())
    batch = pack(samples, family_tokenizer(arch).pad_token_id)
    trained = trainer.logprobs(batch, ROLLOUT.temperature)  # [B, T]
    rolled = batch.rollout_logprobs  # [B, T]
    gap = ((trained - rolled) * batch.response_mask).abs().max().item()
    assert gap <= PARITY_ATOL, f"{arch}: max |trainer - engine| log-prob {gap:.2e}"
    assert trainer.routing_metrics() == ({} if batch.routed_experts is None else {"routing/agreement": 1.0})


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_groups_prompt_computed_once_gives_each_rows_log_probs_and_gradients(arch, rollout, family_dir, family_tokenizer):
    """Where a family can take a group's prompt once (train/prefix.py), the log-probs and gradients of the packed rows
    equal those of one row per sample; a family with linear, sliding-window, chunked or sparse-indexed attention keeps
    its rows."""
    samples = [dataclasses.replace(s, routed_experts=[]) for s in rollout(arch)]  # no replay: it keeps the rows apart
    trainer = TorchTrainer.from_hf(family_dir(arch), TrainConfig())
    assert (trainer._prefix_cost is not None) == (arch in PACKED_ARCHS), arch
    if trainer._prefix_cost is None:
        return
    batch = pack(samples, family_tokenizer(arch).pad_token_id)
    assert len(prefix.groups(batch)) == len(PROMPTS)

    def passes(cost):
        trainer._prefix_cost = cost
        trainer.model.zero_grad()
        logprobs, entropy = trainer._forward(batch, ROLLOUT.temperature)
        (logprobs.sum() + entropy.sum()).backward()
        return logprobs.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}

    (rows, grads), (packed, packed_grads) = passes(None), passes(prefix.PrefixCost(token=1.0, pair=0.0))
    assert ((packed - rows) * batch.response_mask).abs().max().item() <= PARITY_ATOL, arch
    assert grads.keys() == packed_grads.keys()
    for name in grads:
        torch.testing.assert_close(packed_grads[name], grads[name], atol=1e-6, rtol=1e-4, msg=f"{arch}: {name}")


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a not in DENSE_ARCHS])
def test_other_experts_replayed_change_the_logprobs(arch, rollout, family_dir, family_tokenizer):
    """The replay acts on every MoE family's routers: the next expert instead of each recorded one moves the log-probs."""
    samples = rollout(arch)
    experts = moe_sizes(transformers.AutoConfig.from_pretrained(family_dir(arch)).get_text_config(decoder=True))[0]
    moved = [dataclasses.replace(s, routed_experts=[(e + 1) % experts for e in s.routed_experts]) for s in samples]
    trainer = TorchTrainer.from_hf(family_dir(arch), TrainConfig())
    batch = pack(moved, family_tokenizer(arch).pad_token_id)
    gap = ((trainer.logprobs(batch, ROLLOUT.temperature) - batch.rollout_logprobs) * batch.response_mask).abs().max().item()
    assert gap > 1e-3 and trainer.routing_metrics()["routing/agreement"] < 1.0


@pytest.mark.parametrize("arch", FAMILIES)
def test_one_rl_step_changes_the_weights_and_publishes_a_loadable_policy(arch, rollout, family_dir, family_tokenizer, tmp_path):
    samples, tokenizer = rollout(arch), family_tokenizer(arch)
    trainer = TorchTrainer.from_hf(family_dir(arch), TrainConfig(lr=1e-2))
    before = trainer.hf_state_dict()
    fns = bind(rollout=ROLLOUT, algo=AlgoConfig())
    metrics = train_step(trainer, samples, fns, tokenizer.pad_token_id)
    assert trainer.step == 1 and math.isfinite(metrics["train/loss"])
    after = trainer.hf_state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    head = next(name for name, p in trainer.model.named_parameters() if p is trainer.model.get_output_embeddings().weight)
    assert head in changed and any("layers." in name for name in changed)

    manifest = publish(trainer, family_dir(arch), tmp_path / "policy", "float32", version=1, parent_version=0)
    assert manifest["version"] == 1
    check_hf_dir(tmp_path / "policy")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "policy")
    auto = transformers.AutoModelForImageTextToText if is_multimodal(config) else transformers.AutoModelForCausalLM
    published = auto.from_pretrained(tmp_path / "policy", dtype=torch.float32)  # as a user loads it
    ids = torch.tensor([samples[0].prompt_tokens + samples[0].response_tokens])
    with torch.no_grad():
        expected, got = trainer.model.eval()(input_ids=ids).logits, published.eval()(input_ids=ids).logits
    assert torch.allclose(expected, got, atol=1e-5)
