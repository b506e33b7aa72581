"""A few RL steps in bf16 on a tiny task, shared by tests/integration/test_bf16.py (the torch backend, in process)
and tests/megatron_worker.py (the megatron backend, in its own process).

The embedded engine rolls out in bf16 (rollout.dtype), `step.run_step` scores and trains, and the trainer's weights
go back into the engine after each step, as the async phase pushes them. The reward is the fraction of the response's
characters that are ASCII letters: the random tiny policy scores about 0.4 and learns to raise it within a few steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from miles_core.config import ModelConfig, RewardConfig, RolloutConfig
from miles_core.data.source import Prompt, PromptSource
from miles_core.rollout.engines import make_engine
from miles_core.step import bind, run_step
from miles_core.weights.publish import publish

MODEL = ModelConfig(hidden_size=64, num_layers=2, intermediate_size=128)
ROLLOUT = RolloutConfig(prompts_per_step=4, n_samples=8, max_new_tokens=6, dtype="bfloat16")
REWARD = RewardConfig(fn="tests.bf16_runs:letters")
PROMPTS = [Prompt(str(i), f"{i}+{i}=", str(2 * i)) for i in range(8)]
STEPS = 12
MISMATCH = ("mismatch/abs_logprob_diff", "mismatch/kl_rollout_train", "mismatch/ess_ratio", "mismatch/beyond_threshold_fraction")


def letters(response: str, label: str, metadata: dict) -> float:
    """Plug-point reward.fn: the fraction of the response's characters that are ASCII letters."""
    return sum(c.isascii() and c.isalpha() for c in response) / max(len(response), 1)


def rl_steps(trainer, policy_dir: str, steps: int = STEPS) -> list[dict[str, float]]:
    """Each step's mean reward and mismatch metrics."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    fns = bind(rollout=ROLLOUT, reward=REWARD)
    engine, source, history = make_engine(ROLLOUT, policy_dir, 0), PromptSource(PROMPTS, seed=0), []
    assert engine.model.dtype == torch.bfloat16
    for iteration in range(steps):
        _, _, metrics = run_step(engine, source, tokenizer, fns, trainer, [], iteration)
        engine.load_state_dict(trainer.hf_state_dict(), iteration + 1)
        history.append({key: metrics[key] for key in ("reward/mean", *MISMATCH)})
    return history


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def report(trainer, optimizers: list[torch.optim.Optimizer], policy_dir: str, out_dir: Path) -> dict:
    """The run's history, the dtypes of what torch's Adam steps (megatron: its main parameters) and of its moments,
    and those of the weights published in bfloat16."""
    history = rl_steps(trainer, policy_dir)
    stepped = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
    moments = [optimizer.state[p][k] for optimizer in optimizers for p in stepped if p in optimizer.state for k in ("exp_avg", "exp_avg_sq")]
    publish(trainer, policy_dir, out_dir, "bfloat16", version=len(history), parent_version=0)
    published = load_file(str(out_dir / "model.safetensors")).values()
    return {"history": history, "stepped": dtypes(stepped), "moments": dtypes(moments), "moment_count": len(moments), "published": dtypes(published)}


def check_report(result: dict) -> None:
    """Every step's mismatch metrics are finite, the policy improves, and bf16 compute kept fp32 master weights and
    Adam moments while publishing bf16 weights."""
    for step, metrics in enumerate(result["history"]):
        assert all(math.isfinite(metrics[key]) for key in MISMATCH), f"step {step}: {metrics}"
    rewards = [m["reward/mean"] for m in result["history"]]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.2, f"the policy did not improve: mean reward {first:.3f} over the first 3 steps, {last:.3f} over the last 3 ({rewards})"
    assert result["stepped"] == ["float32"] and result["moments"] == ["float32"] and result["moment_count"] > 0
    assert result["published"] == ["bfloat16"]
