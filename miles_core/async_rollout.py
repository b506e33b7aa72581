"""The rollout side of the asynchronous phase: the Ray actor that leases prompts, generates and scores them.

A rollout actor owns one engine (`rollout.engines.make_engine`) and loops: lease `prompts_per_lease`
prompts, run the run's rollout_fn on them as one batch (with dynamic sampling, dynamic_filter_fn drops
groups within the lease and the buffer records their draws as filtered; the trainer waits for enough
groups), then score the rest of the lease and deliver it in a thread while it leases and generates the
next. A remote reward model's wait so overlaps generation, and the actor keeps its reward requests in
flight: it holds as many leases as fill its `reward.remote_concurrency` request slots, plus one whose
requests take the slots the slowest ones leave free (`scoring_leases`; the buffer's bound counts each
lease, so `async_phase.queue_size` still bounds how far the actors run ahead of the trainer). With
partial rollout, generation runs in segments and a weight update lands between segments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from miles_core import step
from miles_core.async_buffer import draw_of
from miles_core.config import AsyncConfig, RewardConfig
from miles_core.cpus import usable_cpus
from miles_core.data.source import Prompt
from miles_core.rollout.engines import make_engine
from miles_core.rollout.partial import generate_segmented
from miles_core.samples import Sample
from miles_core.step import StepFns, bind, groups_of, rollout_seed, scorer_of

if TYPE_CHECKING:  # the phase's spec is defined beside the trainer (async_loop.py), which imports this module
    from miles_core.async_loop import PhaseSpec


class AsyncPhaseError(RuntimeError):
    """The phase cannot finish: a weight push timed out, the trainer starved, or an actor failed."""


def spec_fns(spec: PhaseSpec) -> StepFns:
    return bind(rollout=spec.rollout, reward=spec.reward, algo=spec.algo, hooks=spec.hooks, health=spec.health)


def scoring_leases(reward: RewardConfig, lease_samples: int) -> int:
    """Leases a rollout actor holds at once (generated or being scored): enough that their samples fill the
    reward model's `reward.remote_concurrency` request slots, plus one whose requests take the slots the slowest
    ones leave free; at least two (one scored while the next is generated). More would only queue for a slot and
    age (a lease's samples are as old as the weights that generated them); fewer would leave slots empty."""
    return max(2, math.ceil(reward.remote_concurrency / lease_samples) + 1)


class LeasedPrompts:
    """The data source of one lease for the run's rollout_fn: hands out the leased prompts, then nothing."""

    def __init__(self, prompts: list[Prompt]):
        self._left = list(prompts)

    def next_batch(self, n: int) -> list[Prompt]:
        batch, self._left = self._left[:n], self._left[n:]
        return batch


class TurnTakingEngine:
    """An engine whose every `generate` call holds the actor's engine turn, so a weight update lands
    between calls (between segments with partial rollout, between turns of a multi-turn rollout)."""

    def __init__(self, engine, turn):
        self.engine, self.turn = engine, turn

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts, params):
        with self.turn():
            return self.engine.generate(prompts, params)


def lease_fns(fns: StepFns, cfg: AsyncConfig) -> StepFns:
    """The run's StepFns for one lease: a batch is the lease's prompts (dynamic sampling filters within
    it; the trainer waits for enough groups), and with partial rollout generation runs in segments."""
    rollout = dataclasses.replace(fns.rollout, prompts_per_step=cfg.prompts_per_lease)
    generate_fn = fns.generate_fn
    if cfg.partial_rollout:
        if getattr(generate_fn, "func", generate_fn) is not step.generate:
            raise AsyncPhaseError("async_phase.partial_rollout continues single-turn responses only (rollout.generate_fn must be miles_core.step:generate)")
        generate_fn = functools.partial(generate_segmented, generate_fn=generate_fn, rollout=fns.rollout, cfg=cfg)
    return dataclasses.replace(fns, rollout=rollout, generate_fn=generate_fn)


def actor_threads(cfg: AsyncConfig) -> int:
    """An actor's torch threads: async_phase.threads_per_actor, at most the CPUs its process may use (miles_core/cpus.py)."""
    return min(cfg.threads_per_actor, usable_cpus())


class TimedScorer:
    """A rollout_fn's scorer that adds up the seconds spent scoring (the rest of a lease's busy time is generation)."""

    def __init__(self, scorer):
        self.scorer, self.seconds = scorer, 0.0

    def __call__(self, samples: list[Sample]) -> dict:
        started = time.perf_counter()
        try:
            return self.scorer(samples)
        finally:
            self.seconds += time.perf_counter() - started


class RolloutWorker:
    """A Ray actor (two threads: `run` generates, `update_weights` swaps weights between engine calls)."""

    def __init__(self, index: int, spec: PhaseSpec, buffer):
        import ray  # actors live in Ray worker processes
        from transformers import AutoTokenizer

        threads = actor_threads(spec.cfg)
        torch.set_num_threads(threads)
        self.index, self.spec, self.buffer = index, spec, buffer
        policy_dir = spec.transfer.fetch(spec.policy_dir)
        self.engine = make_engine(spec.rollout, policy_dir, spec.version, num_threads=threads)
        self.tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        # scoring threads decode with their own: a fast tokenizer encoding in one thread may not be read in another ("Already borrowed")
        self.score_tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        self.fns = lease_fns(spec_fns(spec), spec.cfg)
        self.leases_held = scoring_leases(spec.reward, spec.cfg.prompts_per_lease * spec.rollout.n_samples)
        self.lock, self.update_waiting = threading.Lock(), threading.Event()
        latest = ray.get(buffer.register.remote(index))  # a restarted actor resumes from the newest weights
        if latest is not None:
            self.engine.load_state_dict(ray.get(latest[0][0]), latest[1])

    def run(self) -> int:
        """Lease, run the rollout_fn on the lease (generate; with dynamic sampling also score and filter), and lease
        the next while a thread scores the rest of this one and delivers it, until the buffer closes; returns the
        number of leases served. A reward model's wait overlaps generation, and up to `scoring_leases` leases keep
        the actor's reward request slots filled."""
        import ray  # actors live in Ray worker processes

        served, idle_since, scoring = 0, time.perf_counter(), []
        with ThreadPoolExecutor(self.leases_held, thread_name_prefix="score") as pool:
            while True:
                if len(scoring) == self.leases_held:
                    wait(scoring, return_when=FIRST_COMPLETED)
                scoring = _unfinished(scoring)
                prompts = ray.get(self.buffer.lease.remote(self.index, self.spec.cfg.prompts_per_lease))
                if prompts is None:
                    break
                if not prompts:  # the buffer is full: the trainer is behind
                    time.sleep(0.02)
                    continue
                idle, started = time.perf_counter() - idle_since, time.perf_counter()
                scorer = TimedScorer(scorer_of(self.fns, self.score_tokenizer))
                samples, left, _ = self.fns.rollout_fn(
                    TurnTakingEngine(self.engine, self._engine_turn),
                    LeasedPrompts(prompts),
                    self.tokenizer,
                    self.fns,
                    scorer,
                    [],
                    rollout_seed(self.spec.rollout, prompts[0].metadata["draw"]),
                )
                scoring.append(pool.submit(self._score_and_deliver, prompts, groups_of(samples, self.spec.rollout.n_samples) + left, scorer, started, idle))
                served, idle_since = served + 1, time.perf_counter()
            for future in scoring:
                future.result()
        return served

    def _score_and_deliver(self, prompts: list[Prompt], groups: list[list[Sample]], scorer: TimedScorer, started: float, idle: float) -> None:
        import ray  # actors live in Ray worker processes

        samples = [s for g in groups for s in g]
        scorer(samples)  # without dynamic sampling nothing is scored yet
        delivered = {draw_of(g) for g in groups}
        stats = {
            "samples": len(samples),
            "tokens": sum(len(s.response_tokens) for s in samples),
            "busy_s": time.perf_counter() - started,
            "score_s": scorer.seconds,
            "idle_s": idle,
        }
        filtered = [p.metadata["draw"] for p in prompts if p.metadata["draw"] not in delivered]
        ray.get(self.buffer.deliver.remote(self.index, groups, stats, filtered))

    def update_weights(self, state: dict, version: int) -> int:
        self.update_waiting.set()  # the generating thread lets this one in at its next engine call
        try:
            with self.lock:
                self.engine.load_state_dict(state, version)
        finally:
            self.update_waiting.clear()
        return version

    @contextlib.contextmanager
    def _engine_turn(self):
        while self.update_waiting.is_set():
            time.sleep(0.002)
        with self.lock:
            yield


def _unfinished(futures: list[Future]) -> list[Future]:
    """The futures still running; a finished one's error is raised here."""
    finished = [f for f in futures if f.done()]
    for f in finished:
        f.result()
    return [f for f in futures if f not in finished]
