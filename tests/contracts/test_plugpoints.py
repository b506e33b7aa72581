"""Every plug-point: its default and its docs example load and fit the documented signature,
the signature is documented beside the default, bad paths name the field, and the examples run."""

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from miles_core import step
from miles_core.config import ModelConfig, RunConfig
from miles_core.data.problems import make_addition, write_jsonl
from miles_core.data.source import DataState, load_prompts
from miles_core.models.tiny import build_tiny_model
from miles_core.plugins import PLUGPOINTS, PluginError, check_plugins, load_function, plugin
from miles_core.rewards.base import RewardFn
from miles_core.rollout.base import RolloutEngine
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.train.base import Trainer
from miles_core.train.megatron.trainer import MegatronTrainer
from miles_core.train.torch_backend import TorchCritic, TorchTrainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "data.source_fn": "shortest_first",
    "rollout.rollout_fn": "rollout_without_buffer",
    "rollout.generate_fn": "generate_short",
    "rollout.dynamic_filter_fn": "drop_truncated_groups",
    "rollout.buffer_filter_fn": "newest_first",
    "reward.fn": "exact_text",
    "reward.group_fn": "shortest_correct_bonus",
    "reward.post_fn": "length_penalty",
    "algo.advantage_fn": "sign_advantages",
    "algo.loss_fn": "vanilla_pg_loss",
    "algo.is_correction_fn": "clamp_token_weights",
    "algo.sample_filter_fn": "skip_truncated",
    "evaluation.fn": "pass_at_4",
    "hooks.before_train_step": "print_batch",
    "hooks.after_train_step": "stop_on_nan",
    "hooks.after_save": "print_checkpoint",
    "hooks.rollout_log": "reward_by_length",
}


def with_plugins(cfg: RunConfig, paths: dict[str, str]) -> RunConfig:
    sections = {}
    for field, path in paths.items():
        section, name = field.split(".")
        sections.setdefault(section, {})[name] = path
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def test_every_plugpoint_has_an_example():
    assert set(EXAMPLES) == set(PLUGPOINTS)
    guide = (ROOT / "docs" / "plugins.md").read_text()
    for field, name in EXAMPLES.items():
        assert f"`{field}`" in guide and f"docs.examples:{name}" in guide, field


@pytest.mark.parametrize("field", sorted(PLUGPOINTS))
def test_default_fits_and_documents_its_signature(field):
    section, name = field.split(".")
    fn = plugin(getattr(RunConfig(), section), section, name)
    documented = PLUGPOINTS[field]
    assert list(inspect.signature(fn).parameters)[: len(documented)] == list(documented)
    docs = (inspect.getdoc(fn) or "") + (inspect.getmodule(fn).__doc__ or "")
    assert field in docs, f"{field} is not documented beside its default {fn.__qualname__}"


@pytest.mark.parametrize("field", sorted(EXAMPLES))
def test_docs_example_fits_the_signature(field):
    fn = load_function(f"docs.examples:{EXAMPLES[field]}", field, PLUGPOINTS[field])
    assert list(inspect.signature(fn).parameters) == list(PLUGPOINTS[field])


def test_default_reward_fn_fits_the_reward_protocol():
    fn = plugin(RunConfig().reward, "reward", "fn")
    assert list(inspect.signature(fn).parameters) == list(inspect.signature(RewardFn.__call__).parameters)[1:]
    assert fn("132", "132", {}) == 1.0 and fn("garbage", "132", {}) == 0.0


@pytest.mark.parametrize(
    "path, needle",
    [
        ("no_colon", "not a dotted path"),
        ("miles_core.nope:fn", "cannot import module 'miles_core.nope'"),
        ("miles_core.rewards.math:nope", "has no callable 'nope'"),
        ("miles_core.rewards.math:first_integer", "does not take (response, label, metadata)"),
    ],
)
def test_bad_plugin_paths_name_the_field(path, needle):
    with pytest.raises(PluginError) as err:
        check_plugins(with_plugins(RunConfig(), {"reward.fn": path}))
    assert str(err.value).startswith("reward.fn: ") and needle in str(err.value)


def test_a_bad_plugin_fails_the_recipe_before_anything_runs():
    out = subprocess.run(
        [sys.executable, "-m", "miles_core.config", "recipes/smoke.yaml", "algo.loss_fn=docs.examples:exact_text"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "algo.loss_fn: docs.examples:exact_text does not take (algo, logprobs, entropy, mask, extras)" in out.stderr


def protocol_methods(protocol) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize(
    "protocol, implementation", [(RolloutEngine, TorchEngine), (Trainer, TorchTrainer), (Trainer, TorchCritic), (Trainer, MegatronTrainer)]
)
def test_backends_implement_their_protocol(protocol, implementation):
    for name in protocol_methods(protocol):
        mine, theirs = inspect.signature(getattr(implementation, name)), inspect.signature(getattr(protocol, name))
        assert list(mine.parameters)[: len(theirs.parameters)] == list(theirs.parameters), name


def test_all_examples_together_run_a_step(tmp_path, capsys):
    """Every docs example configured at once drives rollout, scoring, training and evaluation."""
    model = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    policy_dir = build_tiny_model(model, str(tmp_path / "base"))
    base = RunConfig()
    cfg = with_plugins(base, {f: f"docs.examples:{n}" for f, n in EXAMPLES.items()})
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_step=4, n_samples=2, dynamic_sampling=True, max_rounds=2))
    check_plugins(cfg)
    train_rows, test_rows = make_addition(cfg.data)
    write_jsonl(train_rows[:64], tmp_path / "train.jsonl")
    write_jsonl(test_rows[:8], tmp_path / "test.jsonl")
    prompts = load_prompts(tmp_path / "train.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    source = plugin(cfg.data, "data", "source_fn")(prompts, 0, DataState())
    first = [len(p.text) for p in source.next_batch(8)]
    assert first == sorted(first) and first[0] == min(len(p.text) for p in prompts)
    fns = step.bind(rollout=cfg.rollout, reward=cfg.reward, algo=cfg.algo, hooks=cfg.hooks, evaluation=cfg.evaluation)
    assert fns.loss_fn.__name__ == "vanilla_pg_loss" and fns.evaluate_fn.__name__ == "pass_at_4"  # every plug-point resolved once
    engine = TorchEngine(policy_dir, 0)
    samples, buffer, metrics = fns.rollout_fn(engine, source, tokenizer, fns, step.scorer_of(fns, tokenizer), [], seed=1)
    assert buffer == [] and all(len(s.response_tokens) <= 4 for s in samples)  # generate_short's budget
    step.score_batch(samples, fns, tokenizer, 0, metrics)
    rewards = [s.reward for s in samples]
    assert all(r == min(max(r, 0.0), 1.0) for r in rewards)  # post-processed, then clamped
    trainer = TorchTrainer.from_hf(policy_dir, cfg.train)
    before = [p.clone() for p in trainer.model.parameters()]
    train_metrics = step.train_step(trainer, samples, fns, tokenizer.pad_token_id)
    assert "mismatch/is_weight_mean" not in train_metrics  # is_correction is "none" unless asked
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert moved or all(s.finish_reason == "length" for s in samples) or len(set(rewards)) == 1
    extra = fns.rollout_log(samples, metrics, 0)
    assert set(extra) == {"rollout/reward_short_half", "rollout/reward_long_half"}
    evaluation = fns.evaluate_fn(engine, load_prompts(tmp_path / "test.jsonl"), tokenizer, fns)
    assert 0.0 <= evaluation["eval/accuracy"] <= evaluation["eval/pass_at_4"] <= 1.0
    assert "training on 8 samples" in capsys.readouterr().out


def test_the_recipe_command_imports_no_model_stack_for_the_projects_own_plugins():
    """A recipe whose plug-points are the defaults is checked and printed without importing torch or transformers (the
    defaults are resolved against their signatures above); one that names other code imports it (the test above)."""
    code = "import sys; from miles_core.config.recipe import main; main(['recipes/tiny_arith_cpu.yaml']); print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[0])["name"] == "tiny_arith_cpu"
    assert out.stdout.splitlines()[-1] == "[]"
