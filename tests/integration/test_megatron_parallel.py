"""The megatron backend on gloo with real megatron-core: TP/PP/EP parity (TP with sequence parallel), resharding, resuming (fp32, and bf16 with
biases), MoE, rollout routing replay (R3), one RL step on each MLA / DeepSeek-style MoE family and gpt-oss (DeepSeek-V3 and
gpt-oss at EP=2 and PP=2, Kimi-K2.5, GLM-4.5, GLM-4.7-Flash, DeepSeek-V2), multi-latent attention at TP=2 (with and
without a query down-projection), and the CPU compatibility layer (every redirection it installs fires on these
paths, none is missing).

One module-scoped set of runs from converted tiny checkpoints; each test reads its part.
"""

import math
import tempfile
from pathlib import Path

import pytest

from miles_core.train.megatron import cpu_compat
from tests.megatron_runs import run_worker

pytestmark = [pytest.mark.integration, pytest.mark.megatron_parallel]
SAME = 1e-5  # fp32 losses of the same weights at other parallel sizes: reduction order only


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory(prefix="megatron-parallel-") as tmp:  # not pytest's rotated temp folders
        yield parallel_runs(Path(tmp))


FAMILIES = {"deepseek_v3": 2, "kimi_k25": 1, "glm4_moe": 1, "glm4_moe_lite": 1, "deepseek_v2": 1, "gpt_oss": 2}  # family -> expert parallel size of its step
SPLIT_BY_STAGES = ("deepseek_v3", "gpt_oss")  # families also stepped at PP=2, against their EP=2 step
RESHARDED = ("tp2", "pp2", "ep2", "tp2_ep2", "deepseek_v3_tp2_ep2")  # runs whose checkpoints (saved split, in root / run) reload whole


def parallel_runs(root: Path) -> dict:
    run_worker("convert", root, "qwen2", "llama", "qwen3_moe", *FAMILIES)
    out = {
        "tp1": run_worker("step", root, root / "qwen2/mg", 1, 1, root / "tp1"),
        "tp2": run_worker("step", root, root / "qwen2/mg", 2, 1, root / "tp2", nproc=2),
        "pp2": run_worker("step", root, root / "llama/mg", 1, 1, root / "pp2", 2, nproc=2),
        "ep2": run_worker("step", root, root / "qwen3_moe/mg", 1, 2, root / "ep2", nproc=2),
        "tp2_ep2": run_worker("step", root, root / "qwen3_moe/mg", 2, 2, root / "tp2_ep2", nproc=2),
        "gpt_oss_tp2_ep2": run_worker("step", root, root / "gpt_oss/mg", 2, 2, root / "gpt_oss-tp2-ep2", nproc=2),
        "deepseek_v3_tp2_ep2": run_worker("step", root, root / "deepseek_v3/mg", 2, 2, root / "deepseek_v3_tp2_ep2", nproc=2),
        "deepseek_v2_tp2_ep2": run_worker("step", root, root / "deepseek_v2/mg", 2, 2, root / "deepseek_v2_tp2_ep2", nproc=2),
        "resume": run_worker("resume", root, root / "qwen2/mg", root / "resumed", nproc=2),
        "resume_bf16_biased": run_worker("resume", root, root / "gpt_oss/mg", root / "resumed-bf16", "bfloat16", nproc=2),
        "replay": run_worker("replay", root, root / "deepseek_v3/hf", root / "deepseek_v3/mg"),
        "replay_tp2_ep2": run_worker("replay", root, root / "deepseek_v3/hf", root / "deepseek_v3/mg", 2, 2, nproc=2),
        "uncompat": run_worker("uncompat", root, root / "qwen2/mg"),
    }
    for arch, ep in FAMILIES.items():
        out[arch] = run_worker("step", root, root / arch / "mg", 1, ep, root / f"{arch}-step", nproc=2 if ep > 1 else 0)
    for arch in SPLIT_BY_STAGES:
        out[f"{arch}_pp2"] = run_worker("step", root, root / arch / "mg", 1, 1, root / f"{arch}-pp2", 2, nproc=2)
    out["reloaded"] = run_worker("loss", root, *(root / name for name in RESHARDED))["losses"]
    out["families_reloaded"] = run_worker("loss", root, *(root / f"{arch}-step" for arch in FAMILIES))["losses"]
    return out


def test_tp1_and_tp2_train_the_same_from_one_checkpoint(runs):
    """TP=2 runs with sequence parallel; the batch's first micro-batch has an odd length, padded for it."""
    tp1, tp2 = runs["tp1"], runs["tp2"]
    assert tp1["loss_before"] == pytest.approx(tp2["loss_before"], abs=SAME)
    assert tp1["train_loss"] == pytest.approx(tp2["train_loss"], abs=SAME)
    assert tp1["grad_norm"] == pytest.approx(tp2["grad_norm"], abs=1e-4)
    assert tp1["loss_after"] == pytest.approx(tp2["loss_after"], abs=SAME)
    assert tp1["loss_after"] < tp1["loss_before"] - 0.01  # the step changed the weights


@pytest.mark.parametrize("run", ["resume", "resume_bf16_biased"])
def test_a_resumed_run_continues_exactly_with_its_optimizer_state(runs, run):
    """DP=2 (each rank holds half of Adam's state): step, save, load, step equals two steps in a row; Qwen2 in fp32,
    and gpt-oss in bf16, whose fp32 norms and bf16 biases share a parameter group (model.py's re-indexing)."""
    resume = runs[run]
    assert resume["steps"] == [2, 2]
    assert resume["resumed"] == resume["straight"]


def test_checkpoints_saved_sharded_load_unsharded_with_the_same_loss(runs):
    """TP=2, PP=2, EP=2 and TP=2 x EP=2 checkpoints (torch_dist; DeepSeek-V3's MLA among them) load at TP=PP=EP=1 with
    the loss they had."""
    for name, reloaded in zip(RESHARDED, runs["reloaded"]):
        assert reloaded == pytest.approx(runs[name]["loss_after"], abs=SAME), name


def test_moe_trains_with_expert_parallel_2(runs):
    ep2 = runs["ep2"]
    assert ep2["loss_after"] < ep2["loss_before"] - 0.01
    assert any("token_dispatcher" in hit for hit in ep2["hits"])  # the alltoall dispatcher really ran


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_frontier_moe_family_takes_an_rl_step(runs, arch):
    """One GRPO step from the converted checkpoint: finite loss and gradient, the weights move, and the saved
    checkpoint (EP=2 for DeepSeek-V3 and gpt-oss) reloads at EP=1 with the loss the trainer had after the step."""
    step = runs[arch]
    assert math.isfinite(step["train_loss"]) and 0 < step["grad_norm"] < math.inf
    assert abs(step["loss_after"] - step["loss_before"]) > 1e-3
    assert runs["families_reloaded"][list(FAMILIES).index(arch)] == pytest.approx(step["loss_after"], abs=SAME)


@pytest.mark.parametrize("arch", SPLIT_BY_STAGES)
def test_a_family_trains_the_same_split_by_experts_or_by_pipeline_stages(runs, arch):
    """EP=2 against PP=2: DeepSeek-V3's dense first layer on one stage, its MoE layer with the shared expert on the
    other; gpt-oss's sliding-window layer on one stage, its full-attention layer on the other."""
    ep2, pp2 = runs[arch], runs[f"{arch}_pp2"]
    for key in ("loss_before", "train_loss", "loss_after"):
        assert pp2[key] == pytest.approx(ep2[key], abs=SAME), key
    assert pp2["grad_norm"] == pytest.approx(ep2["grad_norm"], abs=1e-4)


@pytest.mark.parametrize(
    ("run", "ep2"),
    [("tp2_ep2", "ep2"), ("gpt_oss_tp2_ep2", "gpt_oss"), ("deepseek_v3_tp2_ep2", "deepseek_v3"), ("deepseek_v2_tp2_ep2", "deepseek_v2")],
)
def test_moe_trains_the_same_at_tensor_parallel_2_with_sequence_parallel(runs, run, ep2):
    """TP=2 (sequence parallel: norms and router on half the sequence each, tokens dispatched from both halves) x EP=2
    against EP=2 alone (against one process for DeepSeek-V2, stepped at EP=1): Qwen3-MoE (whose EP=2 equals one
    process bitwise), gpt-oss (biased experts), and multi-latent attention, whose RoPE key every rank's heads share:
    DeepSeek-V3 (query and kv down-projections) and DeepSeek-V2 (kv only)."""
    ep2, tp2 = runs[ep2], runs[run]
    for key in ("loss_before", "train_loss", "loss_after"):
        assert tp2[key] == pytest.approx(ep2[key], abs=SAME), key
    assert tp2["grad_norm"] == pytest.approx(ep2["grad_norm"], abs=1e-4)
    assert any("token_dispatcher" in hit for hit in tp2["hits"])


@pytest.mark.parametrize("run", ["replay", "replay_tp2_ep2"])
def test_the_rollouts_routing_replayed_gives_back_its_logprobs(runs, run):
    """R3 on DeepSeek-V3 (sigmoid routing with a selection bias, 2 expert groups): the embedded engine records its
    routing, then the bias moves (which changes the experts chosen, not the gate values). Replayed, megatron's
    log-probs are the engine's (fp32 reduction order apart, at TP 2 under sequence parallel too); routed by itself,
    they are not, and the agreement logged says how far the routers moved."""
    replay = runs[run]
    assert replay["agreement"] < 0.5  # the move changed most choices
    assert replay["replayed_gap"] < SAME
    assert replay["bare_gap"] > 0.01


def test_every_cpu_redirection_is_needed_and_none_is_missing(runs):
    """Fails when megatron-core stops needing a redirection (it never fires) and when a new CUDA call
    appears on these paths (the runs above fail with "not compiled with CUDA")."""
    hits = set().union(*(runs[k]["hits"] for k in ("tp1", "tp2", "pp2", "ep2", "tp2_ep2", *FAMILIES)))
    expected = [f"{m}:" for m in cpu_compat.TORCH_VIEW_MODULES] + [f"{f}: Tensor.type" for f in cpu_compat.TYPE_NAME_FUNCTIONS]
    expected += [f"{path.split(':')[0]}: {path.split(':')[1]}" for path in cpu_compat.REPLACED_FUNCTIONS]
    unused = [e for e in expected if not any(h.startswith(e) for h in hits)]
    assert not unused, f"redirections that no longer fire: {unused}"
    assert "not compiled with CUDA" in runs["uncompat"]["error"]  # and without the layer the path fails
