"""A group's prompt computed once in the trainer's passes (miles_core/train/prefix.py): the packed layout's structure,
the cost rule that chooses it, and the policy's and the critic's outputs, equal to one row per sample in fp32 (log-probs,
entropy and gradients) and in bf16. Every family's eligibility and parity: tests/families/test_rollout_train.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.config import ModelConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.train import prefix
from miles_core.train.base import PackedBatch, pack
from miles_core.train.torch_backend import TorchCritic, TorchTrainer

ALWAYS = prefix.PrefixCost(token=1.0, pair=0.0)  # packing always estimated cheaper


def sample(prompt: list[int], response: list[int], index: int = 0) -> Sample:
    return Sample("p", index, prompt, response, [-1.0] * len(response), [1] * len(response), "stop", 0, "")


def batch_of_groups():
    """Two groups of three (prompts of 6 and 4 tokens), responses of 1 to 4 tokens, and a lone sample."""
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]
    samples = [sample(a, [20, 21, 22], 0), sample(a, [23], 1), sample(a, [24, 25, 26, 27], 2)]
    samples += [sample(b, [30, 31], 0), sample(b, [32, 33, 34], 1), sample(b, [35], 2), sample([5, 6, 7], [40, 41], 0)]
    return samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), str(tmp_path_factory.mktemp("m") / "qwen2")
    )


def test_runs_of_one_prompt_are_found_by_tokens_and_length():
    samples = batch_of_groups()
    samples.insert(3, sample([5, 6, 7, 8, 9, 11], [1], 3))  # a's length, another last token: a group of its own
    assert [(r.start, r.stop) for r in prefix.groups(pack(samples, 0))] == [(0, 3), (3, 4), (4, 7), (7, 8)]


def test_the_packed_rows_hold_each_prompt_once_and_each_response_at_its_own_positions():
    batch = pack(batch_of_groups(), 0)
    lay = prefix.layout(batch, ALWAYS, torch.float32)
    ids, positions, mask = lay.inputs["input_ids"], lay.inputs["position_ids"], lay.inputs["attention_mask"]
    assert ids.shape == (3, 6 + 3 + 1 + 4)
    assert ids[0].tolist() == [5, 6, 7, 8, 9, 10, 20, 21, 22, 23, 24, 25, 26, 27]
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 6, 7, 8, 9]
    assert ids[1, :10].tolist() == [11, 12, 13, 14, 30, 31, 32, 33, 34, 35]
    seen = mask[0, 0] == 0  # [query, key]
    assert seen[11].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 10, 11]  # the third response's 2nd token: the prompt, itself and before
    assert seen[9].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 9]  # the second response sees no token of the first
    assert seen[:6, 6:].sum() == 0  # the prompt sees no response
    # the outputs before each response token: the prompt's last position, then the response's own tokens
    kept = lay.keep.flatten()[lay.pick]  # [b, T] positions in the packed rows
    assert kept[0].tolist() == [5, 6, 7, 0] and kept[2].tolist() == [5, 10, 11, 12] and kept[5, 0].item() == 3
    got = ids.flatten()[(lay.pick // lay.keep.shape[1]) * ids.shape[1] + kept]  # the token at each kept position
    want = batch.input_ids[:, :-1].gather(1, batch.gather_index)
    assert torch.equal(got * batch.response_mask.long(), want * batch.response_mask.long())


def test_an_empty_response_takes_no_position():
    batch = pack([sample([5, 6, 7], [8, 9], 0), sample([5, 6, 7], [], 1), sample([5, 6, 7], [10], 2)], 0)
    lay = prefix.layout(batch, ALWAYS, torch.float32)
    assert lay.inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    kept = lay.keep.flatten()[lay.pick] * batch.response_mask.long()  # [b, T], 0 where no token
    assert kept.tolist() == [[2, 3], [0, 0], [2, 0]]


# batches of runs: each a prompt (of tokens 1-3, so neighbouring runs may share one) and its responses (some empty)
RUNS = st.lists(
    st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.lists(st.lists(st.integers(4, 60), max_size=6), min_size=1, max_size=5)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(RUNS)
def test_each_response_token_sees_exactly_its_own_sequence(runs):
    """Whatever the runs, prompt lengths and response lengths: the output kept for each response token is computed at
    a packed position that holds the token before it, at that token's own position id, attending to exactly its own
    sample's earlier tokens (the prompt, then its response so far) at their own positions."""
    samples = [sample(prompt, response, i) for prompt, responses in runs for i, response in enumerate(responses)]
    if not any(s.response_tokens for s in samples):
        samples[0] = sample(samples[0].prompt_tokens, [4], 0)
    batch = pack(samples, 0)
    lay = prefix.layout(batch, lambda rows, length: rows, torch.float32)  # fewer rows always estimated cheaper
    if "position_ids" not in lay.inputs:  # declined only where every row is its own run: nothing to share
        assert len(prefix.groups(batch)) == len(samples)
        return
    ids, positions, seen = lay.inputs["input_ids"], lay.inputs["position_ids"], lay.inputs["attention_mask"][:, 0] == 0  # [R, L', L']
    found = prefix.groups(batch)  # one packed row per run, as long as its longest run: the prompt once, then every response
    assert ids.shape == (len(found), max(len(samples[r.start].prompt_tokens) + sum(len(samples[i].response_tokens) for i in r) for r in found))
    width = lay.keep.shape[1]
    for i, s in enumerate(samples):
        sequence = s.prompt_tokens + s.response_tokens
        for j in range(len(s.response_tokens)):
            row, column = divmod(int(lay.pick[i, j]), width)
            at = int(lay.keep[row, column])  # where the output that predicts response token j is computed
            mine = len(s.prompt_tokens) + j  # its predecessor's length-prefix of the sample's own sequence
            assert (int(ids[row, at]), int(positions[row, at])) == (sequence[mine - 1], mine - 1)
            visible = seen[row, at].nonzero().flatten()
            order = positions[row, visible].argsort()
            assert positions[row, visible][order].tolist() == list(range(mine))
            assert ids[row, visible][order].tolist() == sequence[:mine]


class Elsewhere(PackedBatch):
    """A batch whose `.to()` copies, as one on a GPU does when the layout is built on the CPU."""

    def to(self, device):
        return PackedBatch(*(None if t is None else t.clone() for t in self.__dict__.values()))


def test_the_cost_rule_packs_long_prompts_and_keeps_long_responses_apart():
    cost = prefix.PrefixCost(token=1000.0, pair=1.0)
    long_prompt = pack([sample(list(range(3, 203)), [7, 8], i) for i in range(8)], 0)
    long_responses = pack([sample([3, 4], list(range(3, 403)), i) for i in range(8)], 0)
    assert "position_ids" in prefix.layout(long_prompt, cost, torch.float32).inputs
    elsewhere = Elsewhere(*long_responses.__dict__.values())
    declined = prefix.layout(elsewhere, cost, torch.float32)
    assert "position_ids" not in declined.inputs
    assert declined.inputs["input_ids"] is elsewhere.input_ids  # the batch's own tensors, on its device
    assert "position_ids" not in prefix.layout(long_prompt, None, torch.float32).inputs  # a model that cannot take it


def test_only_models_of_global_attention_take_packed_rows():
    qwen2 = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64)
    )
    assert prefix.PrefixCost.of(qwen2) is not None
    mistral = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64, sliding_window=16)
    assert prefix.PrefixCost.of(transformers.MistralForCausalLM(mistral)) is None  # a sliding window the dense mask would not keep
    sliding = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64)
    sliding.layer_types = ["sliding_attention", "full_attention"]
    assert prefix.PrefixCost.of(transformers.Qwen2ForCausalLM(sliding)) is None


def outputs(trainer, batch, cost):
    """(log-probs, entropy, gradients) of one pass of `trainer` over `batch` with `cost` as its packing rule."""
    trainer._prefix_cost = cost
    trainer.model.zero_grad()
    logprobs, entropy = trainer._forward(batch, 0.7)
    (logprobs.sum() + (entropy.sum() if entropy is not None else 0)).backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return logprobs.detach(), None if entropy is None else entropy.detach(), grads


def test_the_policy_passes_equal_one_row_per_sample(model_dir):
    batch = pack(batch_of_groups(), 0)
    trainer = TorchTrainer.from_hf(model_dir, TrainConfig())
    (lp, ent, grads), (lp_packed, ent_packed, grads_packed) = outputs(trainer, batch, None), outputs(trainer, batch, ALWAYS)
    torch.testing.assert_close(lp_packed, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed, ent, atol=1e-5, rtol=0)
    assert grads.keys() == grads_packed.keys()
    for name in grads:
        torch.testing.assert_close(grads_packed[name], grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert lp.abs().sum() > 0 and all(g.abs().sum() > 0 for g in grads.values())


def test_bf16_passes_and_the_critics_values_equal_one_row_per_sample(model_dir, tmp_path):
    batch = pack(batch_of_groups(), 0)
    bf16 = TorchTrainer.from_hf(model_dir, TrainConfig(dtype="bfloat16"))
    torch.testing.assert_close(outputs(bf16, batch, ALWAYS)[0], outputs(bf16, batch, None)[0], atol=0.05, rtol=0)  # bf16 sums in another order
    critic = TorchCritic(TorchCritic.load_model(model_dir), TrainConfig())
    assert critic._prefix_cost is not None
    values, _, grads = outputs(critic, batch, None)
    values_packed, _, grads_packed = outputs(critic, batch, ALWAYS)
    torch.testing.assert_close(values_packed, values, atol=1e-5, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads_packed[name], grads[name], atol=1e-6, rtol=1e-4, msg=name)


def test_replayed_routing_keeps_one_row_per_sample(model_dir):
    """R3 replays the rollout's experts by position in each sample's own row: no packing then."""
    trainer = TorchTrainer.from_hf(model_dir, TrainConfig())
    trainer._prefix_cost, packed = ALWAYS, []
    trainer._kept = lambda run, lay: packed.append("position_ids" in lay.inputs) or TorchTrainer._kept(run, lay)
    batch = pack(batch_of_groups(), 0)
    routed = dataclasses.replace(batch, routed_experts=torch.zeros(len(batch), batch.input_ids.shape[1], 2, dtype=torch.long))
    with torch.no_grad():
        trainer._outputs(batch)
        trainer._outputs(routed)
    assert packed == [True, False]
