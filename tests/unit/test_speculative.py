"""Speculative decoding with an MTP draft head (rollout/speculative.py) and its online training (train/mtp.py),
on a tiny random Qwen2 built here: the output is the policy's, token for token (greedy) and in distribution (sampled)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from miles_core.algos.objective import sft_loss
from miles_core.config import AlgoConfig, LoraConfig, RolloutConfig, TrainConfig
from miles_core.config.base import ConfigError
from miles_core.models.counting import train_counting
from miles_core.models.mtp import build_head, has_head, load_head, save_head
from miles_core.rollout.base import Generation, SamplingParams
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.rollout.speculative import acceptance_metrics, warped_probs
from miles_core.samples import Sample
from miles_core.step import bind, optimize
from miles_core.train.base import PackedBatch, pack
from miles_core.train.mtp import MtpTrainer
from miles_core.train.torch_backend import TorchTrainer

VOCAB = 48
STOP_IDS = (0, 1, 2)
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25], [30], [40, 41, 42, 43]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def flatten(out):
    return [g for gens in out for g in gens]


def own_samples(engine: TorchEngine, seed: int) -> PackedBatch:
    """A batch of the policy's own sampled responses to the test prompts."""
    out = engine.generate(PROMPTS, SamplingParams(n=8, max_new_tokens=12, stop_token_ids=STOP_IDS, seed=seed))
    samples = [
        Sample(str(p), i, prompt, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, 0, "")
        for p, (prompt, gens) in enumerate(zip(PROMPTS, out))
        for i, g in enumerate(gens)
    ]
    return pack(samples, pad_id=0)


def acceptance(engine: TorchEngine) -> float:
    out = flatten(engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=99)))
    return sum(g.accepted_tokens for g in out) / sum(g.drafted_tokens for g in out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A policy directory with an untrained head, and one whose head had 40 MTP-SFT steps on the policy's samples;
    the losses of those steps."""
    root = tmp_path_factory.mktemp("spec")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    untrained_dir, trained_dir = str(root / "untrained"), str(root / "trained")
    model = train_counting(Qwen2ForCausalLM(config), steps=80, stop_id=STOP_IDS[0])  # peaked, learnable by a head
    model.save_pretrained(untrained_dir)
    model.save_pretrained(trained_dir)
    save_head(build_head(config), untrained_dir)
    plain = TorchEngine(untrained_dir, max_batch_sequences=64)
    mtp = MtpTrainer.for_policy(model, untrained_dir, TrainConfig(mtp_lr=3e-3))
    batches = [own_samples(plain, seed) for seed in range(8)]
    losses = [mtp.train_on(model, batches[step % len(batches)])["train/mtp_loss"] for step in range(40)]
    mtp.export(trained_dir)
    return untrained_dir, trained_dir, losses


@pytest.fixture(scope="module")
def engines(trained):
    _, trained_dir, _ = trained
    return TorchEngine(trained_dir), TorchEngine(trained_dir, speculative_tokens=3, max_batch_sequences=4)


def test_head_saved_beside_the_policy_round_trips(trained, tmp_path):
    untrained_dir, _, _ = trained
    assert has_head(untrained_dir) and not has_head(tmp_path)
    head = load_head(untrained_dir)
    save_head(head, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), load_head(tmp_path).state_dict().values()))


def test_greedy_tokens_equal_ordinary_decoding(engines):
    plain, spec = engines
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16, stop_token_ids=STOP_IDS)
    ordinary, speculative = flatten(plain.generate(PROMPTS, params)), flatten(spec.generate(PROMPTS, params))
    assert [g.tokens for g in speculative] == [g.tokens for g in ordinary]
    assert [g.finish_reason for g in speculative] == [g.finish_reason for g in ordinary]
    torch.testing.assert_close(
        torch.tensor([lp for g in speculative for lp in g.logprobs]), torch.tensor([lp for g in ordinary for lp in g.logprobs]), atol=1e-4, rtol=0
    )
    assert sum(g.accepted_tokens for g in speculative) > 0, "the trained head never drafted right: the test checks nothing"


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 0, 0.8), (1.2, 5, 1.0)])
def test_stop_length_and_logprobs_are_the_policys(engines, trained, temperature, top_k, top_p):
    _, spec = engines
    policy = AutoModelForCausalLM.from_pretrained(trained[1], dtype=torch.float32).eval()
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, stop_token_ids=STOP_IDS, seed=4)
    out = spec.generate(PROMPTS, params)
    reasons = set()
    for prompt, gens in zip(PROMPTS, out):
        for g in gens:
            reasons.add(g.finish_reason)
            assert not set(g.tokens[:-1]) & set(STOP_IDS), "nothing may follow a stop token"
            assert (g.tokens[-1] in STOP_IDS) == (g.finish_reason == "stop") and len(g.tokens) <= 10
            assert g.finish_reason == "stop" or len(g.tokens) == 10
            with torch.no_grad():
                logits = policy(input_ids=torch.tensor([prompt + g.tokens])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(g.tokens)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=1e-4, rtol=0)
    assert reasons == {"stop", "length"}


def exact_distribution(policy, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    """P(first `depth` tokens) under the ordinary sampler's warped distribution, by enumerating every continuation."""
    paths = {(): 1.0}
    for _ in range(depth):
        prefixes = list(paths)
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        probs = warped_probs(logits, params)
        paths = {p + (t,): paths[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in probs[i].nonzero().flatten().tolist()}
    return paths


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 4, 1.0), (0.7, 0, 0.6)])
def test_sampled_sequences_follow_the_policys_distribution(trained, temperature, top_k, top_p):
    _, trained_dir, _ = trained
    spec = TorchEngine(trained_dir, speculative_tokens=2, max_batch_sequences=8)
    policy = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()
    prompt, samples = [20, 21, 22], 2000
    # 4 tokens: the round after the first token drafts 2, both among the 3 tokens compared
    params = SamplingParams(n=samples, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=4, seed=7)
    out = spec.generate([prompt], params)[0]
    assert sum(g.accepted_tokens for g in out) > samples // 4, "drafts are rarely accepted: the accepting path is barely tested"
    expected = exact_distribution(policy, prompt, params, depth=3)
    counts = {outcome: 0 for outcome in expected}
    for g in out:
        counts[tuple(g.tokens[:3])] += 1  # a sequence outside the truncated support raises KeyError
    frequent = [o for o, p in expected.items() if p * samples >= 5]  # chi-square wants expected counts >= 5: the rest pooled
    f_obs, f_exp = [counts[o] for o in frequent], [expected[o] * samples for o in frequent]
    f_obs, f_exp = [*f_obs, samples - sum(f_obs)], [*f_exp, samples - sum(f_exp)]
    assert chisquare(f_obs, f_exp).pvalue > 1e-3
    total_variation = 0.5 * sum(abs(counts[o] / samples - p) for o, p in expected.items())
    assert total_variation < 0.08


def test_mtp_sft_lowers_its_loss_and_raises_acceptance(trained):
    untrained_dir, trained_dir, losses = trained
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    before = acceptance(TorchEngine(untrained_dir, speculative_tokens=2))
    after = acceptance(TorchEngine(trained_dir, speculative_tokens=2))
    assert after > before + 0.1, (before, after)


def test_acceptance_metric_counts_drafts_of_every_generation():
    groups = [[Generation([5], [0.0], "length", 0, [], 6, 3)], [Generation([5], [0.0], "length", 0, [], 2, 2), Generation([5], [0.0], "stop", 0)]]
    assert acceptance_metrics(groups) == {"rollout/spec_accept_rate": 5 / 8}
    assert acceptance_metrics([[Generation([5], [0.0], "stop", 0)]]) == {}


def test_policy_without_head_decodes_ordinarily(tmp_path, trained):
    model = AutoModelForCausalLM.from_pretrained(trained[1])
    model.save_pretrained(tmp_path)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    out = flatten(TorchEngine(str(tmp_path), speculative_tokens=3).generate(PROMPTS, params))
    assert out == flatten(TorchEngine(str(tmp_path)).generate(PROMPTS, params))
    assert all(g.drafted_tokens == 0 for g in out)


def test_head_training_leaves_the_policy_alone(trained):
    _, trained_dir, _ = trained
    model = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mtp = MtpTrainer.for_policy(model, trained_dir, TrainConfig(mtp_lr=1e-2))
    mtp.train_on(model, own_samples(TorchEngine(trained_dir), seed=5))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_torch_trainer_trains_checkpoints_and_publishes_the_head(trained, tmp_path):
    untrained_dir = trained[0]
    cfg = TrainConfig(mtp_lr=3e-3)
    trainer = TorchTrainer.from_hf(untrained_dir, cfg)
    assert TorchTrainer.from_hf(untrained_dir, TrainConfig()).mtp is None
    metrics = trainer.train_on(own_samples(TorchEngine(untrained_dir), seed=1), {}, sft_loss, temperature=1.0)
    assert metrics["train/mtp_loss"] > 0 and "train/loss" in metrics
    trainer.save(str(tmp_path / "ckpt"))
    resumed = TorchTrainer.load(str(tmp_path / "ckpt"), cfg)
    assert all(torch.equal(a, b) for a, b in zip(trainer.mtp.head.state_dict().values(), resumed.mtp.head.state_dict().values()))
    assert resumed.mtp.optimizer.state_dict()["state"], "the head's AdamW state is resumed"
    trainer.export_hf(str(tmp_path / "published"), "float32")
    assert has_head(tmp_path / "published")


def rl_acceptance(start: str, root, online: bool, iterations: int = 10) -> tuple[list[float], list[float]]:
    """(acceptance, mean reward) of each of `iterations` GRPO steps from `start` that reward even words, so the policy
    moves from steps of +1 toward +2: rolled out speculatively from each published version, the head trained online
    (train.mtp_lr) or the start's head kept as it was."""
    trainer = TorchTrainer.from_hf(start, TrainConfig(lr=3e-3, mtp_lr=3e-3 if online else 0.0))
    fns = bind(rollout=RolloutConfig(n_samples=8, max_new_tokens=12), algo=AlgoConfig())
    policy, accepted, rewards = start, [], []
    for it in range(iterations):
        out = TorchEngine(policy, it, speculative_tokens=3, max_batch_sequences=4).generate(
            PROMPTS, SamplingParams(n=8, max_new_tokens=12, stop_token_ids=STOP_IDS, seed=it)
        )
        accepted.append(acceptance_metrics(out)["rollout/spec_accept_rate"])
        samples = [
            Sample(
                str(p), i, prompt, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, it, "", reward=sum(t >= 3 and t % 2 == 0 for t in g.tokens) / 12
            )
            for p, (prompt, gens) in enumerate(zip(PROMPTS, out))
            for i, g in enumerate(gens)
        ]
        rewards.append(sum(s.reward for s in samples) / len(samples))
        optimize(trainer, samples, fns, pad_id=0)
        policy = str(root / f"{'online' if online else 'kept'}-{it + 1}")
        trainer.export_hf(policy, "float32")  # with the trained head when it has one
        if not online:
            save_head(load_head(start), policy)
    return accepted, rewards


def test_online_mtp_sft_keeps_acceptance_up_as_rl_moves_the_policy(trained, tmp_path):
    """Measured: online 0.91 -> 0.79-0.91 throughout, kept head 0.91 -> 0.40 by step 10, both rewards 0.34 -> ~0.78."""
    _, trained_dir, _ = trained
    online, online_rewards = rl_acceptance(trained_dir, tmp_path, online=True)
    kept, kept_rewards = rl_acceptance(trained_dir, tmp_path, online=False)
    print(f"acceptance per step: online {[round(a, 2) for a in online]}, kept head {[round(a, 2) for a in kept]}")
    assert online_rewards[-1] > online_rewards[0] + 0.2 and kept_rewards[-1] > kept_rewards[0] + 0.2  # RL moved both policies
    assert sum(kept[-5:]) / 5 < kept[0] - 0.15  # without online training the head falls behind the policy
    assert sum(online[-5:]) / 5 > sum(kept[-5:]) / 5 + 0.15
    assert min(online) > 0.7


@pytest.mark.parametrize(
    "section, fields, key",
    [
        (RolloutConfig, {"speculative_tokens": -1}, "rollout.speculative_tokens"),
        (RolloutConfig, {"speculative_tokens": 2, "routing_replay": True}, "rollout.speculative_tokens"),
        (TrainConfig, {"mtp_lr": -1.0}, "train.mtp_lr"),
        (TrainConfig, {"mtp_lr": 1e-3, "backend": "megatron"}, "train.mtp_lr"),
        (TrainConfig, {"mtp_lr": 1e-3, "lora": LoraConfig(rank=4)}, "train.mtp_lr"),
    ],
)
def test_bad_keys_are_refused_by_name(section, fields, key):
    with pytest.raises(ConfigError, match=key):
        section(**fields)
