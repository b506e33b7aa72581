"""The asynchronous phase: rollout actors and a trainer actor on Ray, K training steps.

    rollout actor i ──lease prompts──► SampleBuffer (bounded, leases) ◄──take groups── trainer actor
         ▲  rollout.rollout_fn on the lease (generate, score, filter), deliver         │ step.train_step
         └──────────── weights (HF state dict through the object store) every k steps ┘

Both kinds of actor run the step functions of `miles_core.step` over the same `StepFns` the sync
tasks use (`bind` on the same config sections), so a multi-turn tool rollout, a remote reward, a
custom rollout_fn and dynamic sampling mean in async mode what they mean in sync mode. Each
rollout actor owns one engine (`rollout.engines.make_engine`) and loops: lease
`prompts_per_lease` prompts, run the run's rollout_fn on them as one batch (with dynamic
sampling, dynamic_filter_fn drops groups within the lease and the buffer records their draws as
filtered; the trainer waits for enough groups), then score the rest of the lease and deliver it
in a thread while it leases and generates the next: the wait on a remote reward model overlaps
generation (an actor holds up to `SCORED_LEASES` leases; the buffer's bound counts each). The
trainer (either backend, through `train.backends`) takes `rollout.prompts_per_step` groups no older than its version minus
`max_staleness` (older ones are dropped or regenerated, `async_phase.stale_policy`), trains with
`step.train_step`, and every `update_weights_interval` steps pushes its
weights to every rollout actor; a push not acknowledged within `push_timeout_s` fails the phase.
With partial rollout, generation runs in segments and a weight update lands between segments:
the response continues under the new weights, and the older policy's tokens may be masked.
Ray restarts a dead rollout actor (`max_restarts`, its `run` call retried); the buffer hands
its leased prompts out again, so nothing drawn is lost or delivered twice.

On a KubeRay cluster the actors run on the worker pods, not the task's: each fetches what it reads
(policy, checkpoint, reference) and the trainer stores what it writes through `spec.transfer` (the
object store), and each actor is pinned to its worker group (`placement`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from miles_core import step
from miles_core.async_buffer import SampleBuffer, draw_of, phase_summary
from miles_core.config import AlgoConfig, AsyncConfig, HealthConfig, HooksConfig, PublishConfig, RewardConfig, RolloutConfig, TrainConfig
from miles_core.cpus import usable_cpus
from miles_core.data.source import DataState, Prompt
from miles_core.plugins import plugin
from miles_core.rollout.engines import make_engine
from miles_core.rollout.partial import generate_segmented
from miles_core.samples import Sample
from miles_core.step import StepFns, bind, groups_of, rollout_seed, score_batch, scorer_of, train_step
from miles_core.storage import Transfer
from miles_core.train.backends import load_trainer, make_trainer
from miles_core.weights.publish import publish
from miles_core.weights.quantize import fake_quantized

# leases a rollout actor holds: one being scored while the next is generated, then scored beside it (its requests take the
# reward model's slots the first one's slowest requests leave free); more would only queue there and age (a lease's samples
# are as old as the weights that generated them), fewer would leave the reward wait unhidden
SCORED_LEASES = 2
ROLLOUT_ACTOR = "miles-rollout-{}"  # Ray actor names (a test kills one mid-phase by name)
# Ray custom resources that the worker groups of the phase's KubeRay cluster declare (tasks/async_phase.py), one per pod
ROLLOUT_GROUP, TRAINER_GROUP = "miles_rollout", "miles_trainer"


class AsyncPhaseError(RuntimeError):
    """The phase cannot finish: a weight push timed out, the trainer starved, or an actor failed."""


@dataclasses.dataclass
class PhaseSpec:
    """Everything one phase reads: config sections, where it starts from, and how far it goes."""

    cfg: AsyncConfig
    rollout: RolloutConfig
    reward: RewardConfig
    algo: AlgoConfig
    train: TrainConfig
    hooks: HooksConfig
    health: HealthConfig
    publish: PublishConfig
    source_fn: object  # the data.source_fn plug-point, resolved
    seed: int  # data.seed
    prompts: list[Prompt]
    state: DataState
    waiting: list[list[Sample]]  # scored groups left by the previous phase
    ckpt_dir: str  # the trainer's checkpoint, policy and KL reference: folders or URIs, which `transfer` fetches
    policy_dir: str
    version: int  # weight version of policy_dir (== the checkpoint's weights)
    reference_dir: str
    first_iteration: int
    steps: int
    transfer: Transfer = dataclasses.field(default_factory=Transfer)


@dataclasses.dataclass
class PhaseResult:
    consumed: list[list[Sample]]  # one batch per training step
    buffer: list[list[Sample]]  # scored groups not consumed, for the next phase
    state: DataState
    dropped: list[str]  # "draw/index" of samples dropped as too stale
    steps: list[dict[str, float]]  # per-step metrics (training + async)
    metrics: dict[str, float]  # phase summary
    filtered: list[int]  # draws whose group dynamic sampling dropped


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
        self.lock, self.update_waiting = threading.Lock(), threading.Event()
        latest = ray.get(buffer.register.remote(index))  # a restarted actor resumes from the newest weights
        if latest is not None:
            self.engine.load_state_dict(ray.get(latest[0][0]), latest[1])

    def run(self) -> int:
        """Lease, run the rollout_fn on the lease (generate; with dynamic sampling also score and filter), and lease
        the next while a thread scores the rest of this one and delivers it, until the buffer closes; returns the
        number of leases served. A reward model's wait overlaps generation, and the next lease's requests fill the
        slots the last one's slowest requests leave free."""
        import ray  # actors live in Ray worker processes

        served, idle_since, scoring = 0, time.perf_counter(), []
        with ThreadPoolExecutor(SCORED_LEASES, thread_name_prefix="score") as pool:
            while True:
                if len(scoring) == SCORED_LEASES:
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


class AsyncTrainer:
    """A Ray actor holding the policy being optimised, with either backend (and the KL reference when
    algo.kl_coef > 0). It is one process: megatron runs in a world of one (gloo on CPU)."""

    def __init__(self, spec: PhaseSpec):
        from transformers import AutoTokenizer

        torch.set_num_threads(actor_threads(spec.cfg))
        parallel = spec.train.tensor_parallel * spec.train.pipeline_parallel * spec.train.expert_parallel
        if spec.train.backend == "megatron" and parallel != 1:
            raise AsyncPhaseError(
                f"the async phase trains in one process: train.tensor_parallel x pipeline_parallel x expert_parallel must be 1, got {parallel}"
            )
        self.spec, self.version, self.fns = spec, spec.version, spec_fns(spec)
        self.ckpt_dir = spec.transfer.fetch(spec.ckpt_dir)
        self.trainer = load_trainer(spec.train, self.ckpt_dir)
        self.reference = make_trainer(spec.train, spec.transfer.fetch(spec.reference_dir)) if spec.algo.kl_coef > 0 else None
        self.tokenizer = AutoTokenizer.from_pretrained(self.ckpt_dir)

    def run(self, buffer, workers: list) -> tuple[list[list[Sample]], list[dict[str, float]]]:
        spec, consumed, steps = self.spec, [], []
        for i in range(spec.steps):
            iteration = spec.first_iteration + i
            groups, depth, idle = self._take(buffer)
            samples = [s for g in groups for s in g]
            for s in samples:
                s.metadata = {**s.metadata, "trainer_version": self.version}
            staleness = [self.version - s.weight_version for s in samples]
            metrics = score_batch(samples, self.fns, self.tokenizer, iteration)  # every group was scored by its rollout actor
            metrics |= {"async/staleness_mean": statistics.fmean(staleness), "async/staleness_max": float(max(staleness))}
            metrics.update(train_step(self.trainer, samples, self.fns, self.tokenizer.pad_token_id, self.reference, None, iteration))
            self.version += 1
            due = (i + 1) % spec.cfg.update_weights_interval == 0 and i + 1 < spec.steps
            metrics.update(
                {
                    "async/trainer_idle_s": idle,
                    "async/weight_push_s": self._push(buffer, workers) if due else 0.0,
                    "async/queue_depth": float(depth),
                    "async/weight_version": float(self.version),
                    "rollout/response_length": statistics.fmean(len(s.response_tokens) for s in samples),
                }
            )
            consumed.append(samples)
            steps.append(metrics)
        return consumed, steps

    def _take(self, buffer) -> tuple[list[list[Sample]], int, float]:
        import ray  # actors live in Ray worker processes

        started, min_version = time.perf_counter(), self.version - self.spec.cfg.max_staleness
        while (taken := ray.get(buffer.take.remote(self.spec.rollout.prompts_per_step, min_version)))[0] is None:
            waited = time.perf_counter() - started
            if waited > self.spec.cfg.take_timeout_s:
                raise AsyncPhaseError(
                    f"the trainer waited {waited:.0f} s (async_phase.take_timeout_s) for {self.spec.rollout.prompts_per_step} "
                    f"groups of weight version >= {min_version}: are the rollout actors alive?"
                )
            time.sleep(0.01)
        return taken[0], taken[1], time.perf_counter() - started

    def _push(self, buffer, workers: list) -> float:
        import ray  # actors live in Ray worker processes

        started, timeout = time.perf_counter(), self.spec.cfg.push_timeout_s
        state = self.trainer.hf_state_dict()
        if self.spec.publish.fmt:  # the engines compute with what a quantized publish would give them
            state = fake_quantized(state, self.spec.publish.fmt)
        ref = ray.put(state)
        ray.get(buffer.set_latest_weights.remote(([ref], self.version)))  # an actor restarting later starts from these
        acks = [w.update_weights.remote(ref, self.version) for w in workers]
        done, pending = ray.wait(acks, num_returns=len(acks), timeout=timeout)
        if pending:
            raise AsyncPhaseError(
                f"weight push of version {self.version} not acknowledged by {len(pending)} of {len(workers)} rollout "
                f"actors within async_phase.push_timeout_s = {timeout} s"
            )
        ray.get(done)
        return time.perf_counter() - started

    def save(self, ckpt_out: str, policy_out: str | None) -> int:
        """The checkpoint in the backend's format (with the tokenizer), then the after_save hook; with policy_out,
        the same weights published as version spec.version + steps. Written on this actor's disk, then stored
        (`spec.transfer`) to ckpt_out and policy_out."""
        with tempfile.TemporaryDirectory(prefix="async-save-") as local:
            ckpt_dir, policy_dir = f"{local}/checkpoint", f"{local}/policy"
            self.trainer.save_atomically(ckpt_dir, self.ckpt_dir)
            self.fns.after_save(ckpt_dir, self.spec.first_iteration + self.spec.steps - 1)
            self.spec.transfer.store(ckpt_dir, ckpt_out)
            if policy_out is not None:
                published = self.spec.publish
                publish(self.trainer, ckpt_dir, policy_dir, published.dtype, self.version, self.spec.version, ckpt_out, published.fmt)
                self.spec.transfer.store(policy_dir, policy_out)
        return self.trainer.step


def spec_fns(spec: PhaseSpec) -> StepFns:
    return bind(rollout=spec.rollout, reward=spec.reward, algo=spec.algo, hooks=spec.hooks, health=spec.health)


def placement(group: str, gpus: int) -> dict:
    """Ray options that pin an actor to its worker group, one actor per pod, with its GPUs: the group's custom
    resource, which every pod of the group declares on a KubeRay cluster (tasks/async_phase.py). A Ray started in
    the task's own process declares no groups: {} (every actor on that one node, on CPU)."""
    import ray  # the async phase is the only part of the core that needs a Ray cluster

    return {"resources": {group: 1}, "num_gpus": gpus} if group in ray.cluster_resources() else {}


def run_phase(spec: PhaseSpec, ckpt_out: str, policy_out: str | None = None) -> PhaseResult:
    """Run spec.steps training steps on the Ray cluster this process is connected to.

    Stores the trainer's checkpoint at ckpt_out (and, with policy_out, its weights published there
    as spec.publish says), folders or URIs as `spec.transfer` takes them; returns the consumed batches, the
    buffer for the next phase and the metrics. Every actor is gone when it returns or raises.
    """
    import ray  # the async phase is the only part of the core that needs a Ray cluster

    cfg, started = spec.cfg, time.perf_counter()
    source = spec.source_fn(spec.prompts, spec.seed, spec.state)
    take_fn = plugin(spec.rollout, "rollout", "buffer_filter_fn")
    buffer = ray.remote(SampleBuffer).options(num_cpus=0).remote(spec.prompts, source, cfg.queue_size, cfg.stale_policy, take_fn, spec.waiting)
    spec_ref = ray.put(spec)  # held until the phase ends: a restarting actor reads its arguments again
    worker_cls, on_rollout_pod = ray.remote(RolloutWorker), placement(ROLLOUT_GROUP, spec.rollout.gpus())
    workers = [
        worker_cls.options(
            name=ROLLOUT_ACTOR.format(i),
            num_cpus=cfg.worker_cpus,
            max_concurrency=2,
            max_restarts=cfg.max_restarts,
            max_task_retries=-1,
            **on_rollout_pod,
        ).remote(i, spec_ref, buffer)
        for i in range(cfg.rollout_workers)
    ]
    on_trainer_pod = placement(TRAINER_GROUP, min(spec.train.gpus_per_node, 1))  # the phase trains in one process
    trainer = ray.remote(AsyncTrainer).options(num_cpus=cfg.trainer_cpus, **on_trainer_pod).remote(spec_ref)
    print(f"async phase: {cfg.rollout_workers} rollout actors and a trainer on {'their worker groups' if on_rollout_pod else 'one Ray node'}")
    try:
        runs = [w.run.remote() for w in workers]
        _wait_for([trainer.__ray_ready__.remote()], runs)
        ready = time.perf_counter()
        trained = trainer.run.remote(buffer, workers)
        _wait_for([trained], runs)
        consumed, steps = ray.get(trained)
        train_s = time.perf_counter() - ready
        ray.get(buffer.close.remote())
        _wait_for(runs, [], timeout=cfg.push_timeout_s + cfg.take_timeout_s)
        if not ray.get(buffer.settled.remote()):
            raise AsyncPhaseError("rollout actors stopped with prompts still leased or waiting: they would be lost")
        optimizer_step = ray.get(trainer.save.remote(ckpt_out, policy_out))
        drained = ray.get(buffer.drain.remote())
    finally:
        for actor in (*workers, trainer, buffer):
            ray.kill(actor, no_restart=True)
    metrics = phase_summary(consumed, steps, drained, train_s)
    metrics.update({"train/step": float(optimizer_step), "time/async_startup_s": ready - started, "time/async_phase_s": time.perf_counter() - started})
    return PhaseResult(consumed, drained["groups"], drained["state"], drained["dropped"], steps, metrics, drained["filtered"])


def _unfinished(futures: list[Future]) -> list[Future]:
    """The futures still running; a finished one's error is raised here."""
    finished = [f for f in futures if f.done()]
    for f in finished:
        f.result()
    return [f for f in futures if f not in finished]


def _wait_for(targets: list, watch: list, timeout: float | None = None) -> None:
    """Wait until every ref in `targets` is done; an error in any of them or in `watch` (the
    rollout loops) fails the phase at once instead of leaving the trainer waiting."""
    import ray  # the async phase is the only part of the core that needs a Ray cluster

    wanted, pending = {r.hex() for r in targets}, [*targets, *watch]
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(r.hex() in wanted for r in pending):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            raise AsyncPhaseError(f"rollout actors did not stop within {timeout:.0f} s of the end of the phase")
        try:
            ray.get(done)
        except ray.exceptions.RayError as err:
            cause = getattr(err, "cause", None)
            raise AsyncPhaseError(f"async phase failed: {cause if isinstance(cause, AsyncPhaseError) else err}") from None
