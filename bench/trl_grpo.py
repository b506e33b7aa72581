"""TRL's side of bench/vs_trl.py, run by TRL's environment's python: GRPOTrainer from the SFT start on the run's train
prompts, scored by the recipe's reward function, with greedy held-out evaluation every `eval_steps` optimizer steps.

    <TRL env>/bin/python bench/trl_grpo.py JOB.json    # JOB written by bench/vs_trl.py (trl_run)

Each evaluation (at the start, every eval_steps steps and at the last) appends a JSON line to the job's points_file:
step (optimizer steps), completions (scored so far), rl_s (the trainer's wall time since on_train_begin, evaluations
excluded), wall (epoch seconds when the evaluation began), paused_s (seconds of evaluation before it), accuracy.
Evaluation is the workflow's: the policy saved as an HF directory, served by the rollout engine, judged by
`evaluation.fn` on the held-out split.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from miles_core.config import load_recipe
from miles_core.data.source import load_prompts
from miles_core.rollout.engines import make_engine
from miles_core.step import bind


class HeldOut(TrainerCallback):
    """Held-out accuracy at the start, every `every` optimizer steps and at the last, the trainer's clock paused."""

    def __init__(self, cfg, tokenizer, test_file: str, every: int, points_file: str, scored: list[int], policy_dir: str, device: str):
        self.cfg, self.tokenizer, self.every, self.points_file, self.scored, self.device = cfg, tokenizer, every, points_file, scored, device
        self.prompts, self.policy_dir = prompts_of(test_file, cfg), policy_dir
        self.fns = bind(rollout=cfg.rollout, reward=cfg.reward, evaluation=cfg.evaluation)
        tokenizer.save_pretrained(policy_dir)
        self.began, self.paused_s = 0.0, 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.began = time.perf_counter()
        self._evaluate(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._evaluate(state.global_step, model)

    def _evaluate(self, step: int, model) -> None:
        paused, wall = time.perf_counter(), time.time()
        model.save_pretrained(self.policy_dir)
        engine = make_engine(self.cfg.rollout, self.policy_dir, step, max_batch_sequences=self.cfg.evaluation.batch_size, device=self.device)
        accuracy = self.fns.evaluate_fn(engine, self.prompts, self.tokenizer, self.fns)["eval/accuracy"]
        point = {"step": step, "completions": self.scored[0], "rl_s": paused - self.began - self.paused_s, "wall": wall, "paused_s": self.paused_s}
        with open(self.points_file, "a") as out:
            out.write(json.dumps({**point, "accuracy": accuracy}) + "\n")
        print(f"TRL step {step}: held-out accuracy {accuracy:.3f}", file=sys.stderr, flush=True)
        self.paused_s += time.perf_counter() - paused


def prompts_of(path: str, cfg) -> list:
    return load_prompts(path, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)


def reward_of(fns, scored: list[int]):
    """TRL's reward function signature over the recipe's reward function; counts the completions it scores."""

    def answer_reward(completions, label, metadata, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: the assistant turn
        scored[0] += len(texts)
        return [float(fns.reward_fn(t, y, json.loads(m))) for t, y, m in zip(texts, label, metadata)]

    return answer_reward


def main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    cfg = load_recipe(job["recipe"])
    rows = [
        {"prompt": [{"role": "user", "content": p.text}] if isinstance(p.text, str) else p.text, "label": p.label, "metadata": json.dumps(p.metadata)}
        for p in prompts_of(job["train_file"], cfg)
    ]
    tokenizer = AutoTokenizer.from_pretrained(job["start_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["start_dir"], dtype=torch.float32)
    scored = [0]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            learning_rate=job["learning_rate"],
            max_steps=job["max_steps"],
            use_cpu=job["device"] == "cpu",
            report_to="none",
            save_strategy="no",
            logging_steps=job["eval_steps"],
            disable_tqdm=True,
            dataloader_num_workers=0,
            **job["settings"],
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_of(bind(rollout=cfg.rollout, reward=cfg.reward), scored),
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[HeldOut(cfg, tokenizer, job["test_file"], job["eval_steps"], job["points_file"], scored, str(Path(out) / "policy"), job["device"])],
        )
        trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
