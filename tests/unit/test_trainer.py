"""The torch trainer: packing, a GRPO step that moves the policy the right way, bitwise resume, data parallelism."""

import dataclasses
import math

import pytest
import torch

from miles_core.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.step import bind, optimize
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_model(TINY, str(tmp_path_factory.mktemp("m") / "base"))


def groups(rewards):
    # two groups of two: the same prompt answered with token 10 (rewarded) or token 11 (not)
    return [Sample("p", i, [1, 20, 21], [10 if r else 11, 2], [-1.0, -1.0], [1, 1], "stop", 0, "x", {}, r) for i, r in enumerate(rewards)]


def rows_apart(trainer: TorchTrainer) -> TorchTrainer:
    """`trainer` computing every sample in its own row. With a group's prompt computed once (train/prefix.py), the
    packed rows depend on which rows a process holds; their sums then round otherwise, and Adam's first step moves a
    weight whose gradient is only rounding (a key bias: softmax ignores it) by about lr either way. The packed rows'
    parity with separate ones: tests/unit/test_prefix.py."""
    trainer._prefix_cost = None
    return trainer


def test_pack_aligns_response_tokens_with_their_predicting_positions():
    s = [Sample("a", 0, [1, 2, 3], [4, 5], [-0.1, -0.2], [1, 0], "stop", 0, "", {}), Sample("b", 0, [1], [6, 7, 8], [-0.3] * 3, [1, 1, 1], "length", 0, "", {})]
    b = pack(s, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 7, 8, 0]]
    # logits at position t predict token t+1: "a"'s response starts after 3 prompt tokens
    assert b.gather_index.tolist() == [[2, 3, 0], [0, 1, 2]]
    assert b.input_ids[:, 1:].gather(1, b.gather_index).tolist() == [[4, 5, 2], [6, 7, 8]]  # [0, 2] is padding, masked
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.loss_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    # one value short in one sample and one over in the next: refused naming the sample, never shifted into place
    s[0].loss_mask, s[1].loss_mask = [1], [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"sample a/0: loss_mask has 1 values for 2 response tokens"):
        pack(s, pad_id=0)


def test_logprobs_match_a_plain_forward_pass(policy_dir):
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig())
    samples = groups([1.0, 0.0])
    lp = trainer.logprobs(pack(samples, 0), temperature=1.0)
    with torch.no_grad():
        logits = trainer.model(torch.tensor([[1, 20, 21, 10, 2]])).logits[0]
    expected = torch.log_softmax(logits, -1)[[2, 3], [10, 2]]
    assert torch.allclose(lp[0], expected, atol=1e-5)


def test_grpo_step_raises_the_rewarded_response(policy_dir):
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig(lr=1e-2))
    samples = groups([1.0, 0.0, 1.0, 0.0])
    before = trainer.logprobs(pack(samples, 0), 1.0)[:, 0]
    metrics = train(trainer, samples, AlgoConfig(), 2, 1.0, 0)
    after = trainer.logprobs(pack(samples, 0), 1.0)[:, 0]
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.step == 1 and metrics["train/step"] == 1.0
    assert metrics["train/clip_fraction"] == 0.0  # ratio is 1 on the first (only) mini-batch
    assert metrics["mismatch/abs_logprob_diff"] > 0  # the samples' rollout log-probs (-1.0) are not the model's


# Adam's first step moves a weight by about lr whatever its gradient's size, so a few near-zero gradients rounded
# otherwise move the other way; a lost micro-batch moves ~half. fp32: one micro-batch of the group computes its prompt once
# (train/prefix.py) and the output head over 4 rows' positions, four compute it apart, summing in another order (measured:
# 0.01% of the embedding, the rows of tokens the batch never holds, tied to the head). bf16: the micro-batches' bf16
# gradients are summed in fp32 (measured: 1%).
@pytest.mark.parametrize(("dtype", "moved_otherwise"), [("float32", 0.001), ("bfloat16", 0.02)])
def test_micro_batching_does_not_change_the_update(policy_dir, dtype, moved_otherwise):
    samples = groups([1.0, 0.0, 0.0, 1.0])
    results = []
    for micro in (4, 1):
        trainer = TorchTrainer.from_hf(policy_dir, TrainConfig(lr=1e-2, micro_batch_size=micro, dtype=dtype))
        train(trainer, samples, AlgoConfig(), group_size=2, temperature=1.0, pad_id=0)
        results.append(trainer.model.model.embed_tokens.weight.detach().clone())
    assert ((results[0] - results[1]).abs() > 1e-6).float().mean() <= moved_otherwise


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the compute copy follows every optimizer step and a load
def test_save_load_resumes_bitwise(policy_dir, tmp_path, dtype):
    cfg = TrainConfig(lr=1e-2, mini_batches=2, dtype=dtype)
    samples = groups([1.0, 0.0, 0.0, 1.0])
    straight = TorchTrainer.from_hf(policy_dir, cfg)
    for _ in range(2):
        train(straight, samples, AlgoConfig(), 2, 1.0, 0)
    resumed = TorchTrainer.from_hf(policy_dir, cfg)
    train(resumed, samples, AlgoConfig(), 2, 1.0, 0)
    resumed.save(str(tmp_path / "ckpt"))
    resumed = TorchTrainer.load(str(tmp_path / "ckpt"), cfg)
    assert resumed.step == 2
    train(resumed, samples, AlgoConfig(), 2, 1.0, 0)
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_trainer_resumed_in_place_continues_as_one_loaded(policy_dir, tmp_path, dtype):
    """`resume`: the trainer a train stage kept, holding the weights, optimizer state, gradients and bf16 copy of its own
    steps, takes the next checkpoint in place and then trains bit for bit as a trainer `load` built from it; a checkpoint it
    cannot take (another config, another model) is refused with nothing changed."""
    cfg = TrainConfig(lr=1e-2, mini_batches=2, dtype=dtype)
    samples = groups([1.0, 0.0, 0.0, 1.0])
    start = TorchTrainer.from_hf(policy_dir, cfg)
    start.save(str(tmp_path / "c0"))
    kept = TorchTrainer.load(str(tmp_path / "c0"), cfg)
    train(kept, samples, AlgoConfig(), 2, 1.0, 0)  # its own state, which the resume must replace
    other = TorchTrainer.from_hf(policy_dir, cfg)
    train(other, samples, AlgoConfig(), 2, 1.0, 0)
    train(other, samples, AlgoConfig(), 2, 1.0, 0)
    other.save(str(tmp_path / "c1"))

    loaded = TorchTrainer.load(str(tmp_path / "c1"), cfg)
    train(loaded, samples, AlgoConfig(), 2, 1.0, 0)
    assert kept.resume(str(tmp_path / "c1"), cfg) and kept.step == 4
    train(kept, samples, AlgoConfig(), 2, 1.0, 0)
    assert kept.step == loaded.step == 6
    for a, b in zip(loaded.model.state_dict().values(), kept.model.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(loaded.optimizer.state.values(), kept.optimizer.state.values()):
        assert all(torch.equal(a[key], b[key]) for key in a)

    before = [t.clone() for t in kept.model.state_dict().values()]
    wider = build_tiny_model(dataclasses.replace(TINY, hidden_size=64), str(tmp_path / "wider"))
    TorchTrainer.from_hf(wider, cfg).save(str(tmp_path / "c-wider"))
    assert not kept.resume(str(tmp_path / "c1"), dataclasses.replace(cfg, lr=1e-3))
    assert not kept.resume(str(tmp_path / "c-wider"), cfg)
    assert kept.step == 6 and all(torch.equal(a, b) for a, b in zip(before, kept.model.state_dict().values()))


def test_a_weights_only_load_reads_the_weights_and_leaves_the_optimizer_and_the_rng_alone(policy_dir, tmp_path):
    """What publishing loads: the checkpoint's weights, no optimizer state, this process's RNG as it was."""
    cfg = TrainConfig(lr=1e-2)
    trained = TorchTrainer.from_hf(policy_dir, cfg)
    train(trained, groups([1.0, 0.0, 0.0, 1.0]), AlgoConfig(), 2, 1.0, 0)
    trained.save(str(tmp_path / "ckpt"))
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    read = TorchTrainer.load(str(tmp_path / "ckpt"), cfg, weights_only=True)
    assert torch.equal(torch.get_rng_state(), rng) and not read.optimizer.state_dict()["state"]
    assert all(torch.equal(a, b) for a, b in zip(trained.model.state_dict().values(), read.model.state_dict().values()))
    resumed = TorchTrainer.load(str(tmp_path / "ckpt"), cfg)
    assert resumed.optimizer.state_dict()["state"] and not torch.equal(torch.get_rng_state(), rng)


def test_kl_term_needs_and_uses_the_reference(policy_dir):
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig(lr=1e-2))
    reference = TorchTrainer.from_hf(policy_dir, TrainConfig())
    algo = dataclasses.replace(AlgoConfig(), kl_coef=0.1)
    train(trainer, groups([1.0, 0.0]), algo, 2, 1.0, 0, reference=reference)
    metrics = train(trainer, groups([1.0, 0.0]), algo, 2, 1.0, 0, reference=reference)
    assert metrics["train/kl"] > 0  # the policy moved away from the reference after one step


def test_a_failing_reward_fn_scores_min_and_is_recorded():
    from miles_core.step import score

    class Tok:
        def decode(self, tokens, skip_special_tokens=True):
            return "boom" if tokens[0] == 11 else "ok"

    def reward_fn(response, label, metadata):
        if response == "boom":
            raise RuntimeError("parser exploded")
        return float("nan") if metadata.get("nan") else 5.0  # clipped to reward.max

    samples = groups([1.0, 0.0])  # responses start with 10 and 11
    for s in samples:
        s.reward = float("nan")  # not scored yet
    samples[0].metadata = {"nan": True}
    metrics = score(samples, with_reward(reward_fn), Tok(), group_size=2)
    assert [s.reward for s in samples] == [0.0, 0.0] and metrics["reward/failures"] == 2.0
    assert "RuntimeError: parser exploded" in samples[1].metadata["reward_error"]
    assert "not finite (nan)" in samples[0].metadata["reward_error"]
    samples[0].metadata, samples[0].reward = {}, float("nan")
    score(samples, with_reward(reward_fn), Tok(), group_size=2)
    assert samples[0].reward == 1.0  # 5.0 clipped to [reward.min, reward.max]


def train(trainer, samples, algo, group_size, temperature, pad_id, reference=None):
    """One RL update with the default plug-points, `algo` and groups of group_size sampled at temperature."""
    return optimize(trainer, samples, bind(algo=algo, rollout=RolloutConfig(n_samples=group_size, temperature=temperature)), pad_id, reference=reference)


def with_reward(reward_fn):
    """The default StepFns with reward.fn replaced by a test's function (a plug-point resolved in place)."""
    import dataclasses

    return dataclasses.replace(bind(), reward_fn=reward_fn)


def _data_parallel_step(rank: int, world: int, policy_dir: str, port: int, out: str) -> None:
    """One process of a data-parallel run (as a kfpytorch Elastic / torchrun worker sees it: RANK, WORLD_SIZE in its env)."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = rows_apart(TorchTrainer.from_hf(policy_dir, TrainConfig(lr=1e-2, mini_batches=2)))
    metrics = train(trainer, groups([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]), AlgoConfig(), 2, 1.0, 0)
    if rank == 0:
        torch.save({"state": trainer.model.state_dict(), "metrics": metrics}, out)
    dist.destroy_process_group()


def test_two_data_parallel_processes_train_like_one(policy_dir, tmp_path):
    """Each of 2 processes trains its half of every mini-batch and the gradients are summed: the same
    update as one process on the whole mini-batch (the aggregation weights normalise over the whole
    mini-batch, so the sum of the halves' gradients is its gradient), up to float summation order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_data_parallel_step, args=(2, policy_dir, port, str(tmp_path / "dp.pt")), nprocs=2)
    parallel = torch.load(tmp_path / "dp.pt", weights_only=False)
    trainer = rows_apart(TorchTrainer.from_hf(policy_dir, TrainConfig(lr=1e-2, mini_batches=2)))
    single = train(trainer, groups([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]), AlgoConfig(), 2, 1.0, 0)
    for name, value in trainer.model.state_dict().items():
        assert torch.allclose(parallel["state"][name], value, atol=1e-6), name
    assert parallel["metrics"]["train/loss"] == pytest.approx(single["train/loss"], abs=1e-6)
    assert parallel["metrics"]["train/step"] == single["train/step"] == 2.0


def test_advantages_see_the_loss_mask_and_kl_in_the_reward_its_clamp(policy_dir):
    """The step hands advantage_fn the samples' loss masks (a tool's tokens are no step of the policy)
    and shapes the reward with a KL whose log-ratio is clamped to algo.log_ratio_clamp."""
    seen = {}
    default = bind().advantage_fn

    def advantage_fn(algo, rewards, mask, group_size, kl, values):
        seen["mask"], seen["kl"] = mask.clone(), kl.clone()
        return default(algo, rewards, mask, group_size, kl, values)

    trainer, reference = TorchTrainer.from_hf(policy_dir, TrainConfig()), TorchTrainer.from_hf(policy_dir, TrainConfig())
    algo = AlgoConfig(advantage="reinforce_plus_plus", kl_coef=0.1, kl_in_reward=True, use_rollout_logprobs=True, log_ratio_clamp=1.5)
    samples = groups([1.0, 0.0])
    samples[0].loss_mask = [1, 0]  # the second token is a tool's
    fns = dataclasses.replace(bind(algo=algo, rollout=RolloutConfig(n_samples=2)), advantage_fn=advantage_fn)
    optimize(trainer, samples, fns, 0, reference=reference)
    assert seen["mask"].tolist() == [[1, 0], [1, 1]]
    log_ratio = reference.logprobs(pack(samples, 0), 1.0) - torch.tensor(-1.0)  # the reference's against the rollout's (-1.0)
    assert (log_ratio < -1.5).all()  # every log-ratio is past the clamp, so the clamp decides the KL
    assert torch.allclose(seen["kl"], torch.full((2, 2), math.exp(-1.5) + 1.5 - 1.0))


def test_a_trainer_computes_where_the_recipe_gives_it_gpus(monkeypatch):
    """train.gpus_per_node: each process trains on its own GPU (LOCAL_RANK, as torch elastic numbers its workers); a
    process that sees no CUDA device refuses, naming the key, instead of training on the CPU of a GPU pod."""
    from miles_core.train.torch_backend import train_device

    assert train_device(TrainConfig()) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="train.gpus_per_node is 2, but this process sees no CUDA device"):
        train_device(TrainConfig(gpus_per_node=2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert train_device(TrainConfig(gpus_per_node=2)) == "cuda:1"


def test_convert_and_publish_of_a_gpu_recipe_need_no_gpu(policy_dir, tmp_path, monkeypatch):
    """The convert and publish pods of a recipe that trains on GPUs have none: they read and write on the CPU."""
    from miles_core.config import PublishConfig
    from miles_core.train.backends import convert_checkpoint, export_policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = TrainConfig(gpus_per_node=2, nproc_per_node=2)
    convert_checkpoint(cfg, AlgoConfig(advantage="ppo"), policy_dir, tmp_path / "ckpt")
    manifest = export_policy(cfg, str(tmp_path / "ckpt"), tmp_path / "policy", PublishConfig(), 1, 0)
    assert manifest["version"] == 1 and (tmp_path / "policy" / "model.safetensors").exists()
