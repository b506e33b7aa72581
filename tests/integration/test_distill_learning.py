"""Learning is a tested property: on-policy distillation lifts a smaller student's held-out accuracy toward a bigger
teacher's, with the task reward left out (distill.with_reward false), so the teacher's log-probs are the only signal.

Run in this process with the step's own functions, as the sync tasks run them stage by stage (rollout_fn, score_batch,
the teacher's score_with_teacher, train_step). Both models are built here, cheaply, on the addition problem set, from
one start: the smoke recipe's policy (64 wide, 2 layers) SFT-trained on demonstrations that drop every carry
(data.teacher_carry_error 1), which finds column addition quickly and answers the problems without a carry.
* the student: that start SFT-trained a little on demonstrations that drop 60% of carries, as the main recipe's SFT
  start (held-out greedy accuracy about 0.59): its samples carry 40% of the time, so the teacher has tokens to grade;
* the teacher: that start grown by a third layer that starts as the identity (its output projections zero), then
  SFT-trained on correct demonstrations: bigger, the same tokenizer, and right on most carries (about 0.95).
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_core.config import AlgoConfig, DataConfig, DistillConfig, EvalConfig, ModelConfig, RolloutConfig, SFTConfig, TrainConfig
from miles_core.data.problems import make_problem_set, write_jsonl
from miles_core.data.source import PromptSource, load_prompts
from miles_core.distill import load_teacher, score_with_teacher
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.step import bind, evaluate, rollout_seed, score_batch, scorer_of, train_step
from miles_core.train.sft import demonstrations, run_sft, sft_train_config
from miles_core.train.torch_backend import TorchTrainer

pytestmark = pytest.mark.integration

STUDENT = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192)
TEACHER_LAYERS = 3
ITERATIONS = 24  # of 256 prompts x 4 samples
GAP_CLOSED = 0.3  # the share of the teacher's lead over the student that distillation must win


def sft(policy_dir: str, out_dir: str, prompts, steps: int, lr: float) -> str:
    """policy_dir SFT-trained on the prompts' demonstrations, saved (with its tokenizer) at out_dir."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    cfg = SFTConfig(steps=steps, lr=lr, batch_size=64, warmup_steps=20)
    trainer = TorchTrainer.from_hf(policy_dir, sft_train_config(cfg))
    run_sft(trainer, demonstrations(prompts, tokenizer), cfg, tokenizer.pad_token_id)
    trainer.export_hf(out_dir, "float32")
    tokenizer.save_pretrained(out_dir)
    return out_dir


def grown(policy_dir: str, out_dir: str, layers: int) -> str:
    """The policy with layers appended that pass their input through (zero attention and MLP output projections): a
    bigger model computing exactly the same function, for SFT to improve."""
    small = AutoModelForCausalLM.from_pretrained(policy_dir)
    config = small.config.to_dict() | {"num_hidden_layers": layers, "layer_types": [small.config.layer_types[0]] * layers}
    big = AutoModelForCausalLM.from_config(type(small.config).from_dict(config))
    state = big.state_dict() | small.state_dict()
    for layer in range(small.config.num_hidden_layers, layers):
        state[f"model.layers.{layer}.self_attn.o_proj.weight"].zero_()
        state[f"model.layers.{layer}.mlp.down_proj.weight"].zero_()
    big.load_state_dict(state)
    big.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(policy_dir).save_pretrained(out_dir)
    return out_dir


def accuracy(engine: TorchEngine, prompts, fns) -> float:
    """Greedy held-out accuracy of the engine's current weights."""
    return evaluate(engine, prompts, AutoTokenizer.from_pretrained(engine.policy_dir), fns)["eval/accuracy"]


def problems(tmp_path, carry_errors: tuple[float, ...]) -> tuple[dict, list]:
    """({carry error: the train problems' demonstrations when each carry is dropped with that probability}, the
    held-out problems: the same for each, the split depends on the seed only)."""
    demonstrations_of = {}
    for carry_error in carry_errors:
        train, test = make_problem_set(DataConfig(digits=2, train_size=4000, test_size=128, teacher_carry_error=carry_error))
        write_jsonl(train, tmp_path / f"train-{carry_error}.jsonl")
        write_jsonl(test, tmp_path / "test.jsonl")
        demonstrations_of[carry_error] = load_prompts(tmp_path / f"train-{carry_error}.jsonl")
    return demonstrations_of, load_prompts(tmp_path / "test.jsonl")


def student(tmp_path, demonstrations_of: dict) -> tuple[str, str]:
    """(the SFT start on demonstrations that drop every carry, the student: it after a little on those that drop 60%)."""
    start = sft(build_tiny_model(STUDENT, str(tmp_path / "base")), str(tmp_path / "start"), demonstrations_of[1.0], steps=400, lr=0.005)
    return start, sft(start, str(tmp_path / "student"), demonstrations_of[0.6], steps=100, lr=0.002)


def test_distillation_alone_lifts_the_students_held_out_accuracy_toward_the_teachers(tmp_path):
    demonstrations_of, held_out = problems(tmp_path, (1.0, 0.6, 0.0))
    start, student_dir = student(tmp_path, demonstrations_of)
    teacher_dir = sft(grown(start, str(tmp_path / "grown"), TEACHER_LAYERS), str(tmp_path / "teacher"), demonstrations_of[0.0], steps=200, lr=0.002)

    rollout = RolloutConfig(prompts_per_step=256, n_samples=4, max_new_tokens=4)
    distill = DistillConfig(teacher=teacher_dir, mode="kl", coef=1.0, with_reward=False)
    fns = bind(rollout=rollout, algo=AlgoConfig(), evaluation=EvalConfig(max_new_tokens=4), distill=distill)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    engine, teacher = TorchEngine(student_dir), load_teacher(distill, teacher_dir)
    before, teacher_accuracy = accuracy(engine, held_out, fns), accuracy(TorchEngine(teacher_dir), held_out, fns)
    trainer = TorchTrainer.from_hf(student_dir, TrainConfig(lr=0.0005, warmup_steps=5, mini_batches=4))
    source, reverse_kl = PromptSource(demonstrations_of[0.0], seed=0), []
    for iteration in range(ITERATIONS):
        samples, _, metrics = fns.rollout_fn(engine, source, tokenizer, fns, scorer_of(fns, tokenizer), [], rollout_seed(rollout, iteration))
        score_batch(samples, fns, tokenizer, iteration, metrics)  # rewards for the record only: with_reward false
        score_with_teacher(teacher, samples, tokenizer.pad_token_id, rollout.temperature)
        reverse_kl.append(train_step(trainer, samples, fns, tokenizer.pad_token_id, iteration=iteration)["distill/reverse_kl"])
        engine.load_state_dict(trainer.hf_state_dict(), iteration + 1)
    after = accuracy(engine, held_out, fns)
    print(f"held-out accuracy: student {before:.3f} -> {after:.3f}, teacher {teacher_accuracy:.3f}; reverse KL per token {[round(k, 3) for k in reverse_kl]}")
    assert teacher_accuracy >= before + 0.2, f"the teacher ({teacher_accuracy:.3f}) is hardly better than the student ({before:.3f}): nothing to distil"
    assert after >= before + GAP_CLOSED * (teacher_accuracy - before), (
        f"distillation did not learn: {before:.3f} -> {after:.3f} (teacher {teacher_accuracy:.3f})"
    )
    assert sum(reverse_kl[-4:]) < 0.8 * sum(reverse_kl[:4])  # on its own samples the student moved toward the teacher
    assert teacher.step == 0  # the teacher is frozen: only its log-probs were read
