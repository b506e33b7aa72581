"""The asynchronous phase: rollout actors and a trainer actor on Ray, K training steps.

    rollout actor i ──lease prompts──► SampleBuffer (bounded, leases) ◄──take groups── trainer actor
         ▲  rollout.rollout_fn on the lease (generate, score, filter), deliver         │ step.train_step
         └──────────── weights (HF state dict through the object store) every k steps ┘

Both kinds of actor run the step functions of `miles_core.step` over the same `StepFns` the sync
tasks use (`bind` on the same config sections), so a multi-turn tool rollout, a remote reward, a
custom rollout_fn and dynamic sampling mean in async mode what they mean in sync mode. Each
rollout actor (`async_rollout.RolloutWorker`) leases prompts, generates and scores them, and
delivers their groups, scoring in threads while it generates the next leases. The
trainer (either backend, through `train.backends`) takes `rollout.prompts_per_step` groups no older than its version minus
`max_staleness` (older ones are dropped or regenerated, `async_phase.stale_policy`), trains with
`step.train_step`, and every `update_weights_interval` steps pushes its
weights to every rollout actor; a push not acknowledged within `push_timeout_s` fails the phase.
Ray restarts a dead rollout actor (`max_restarts`, its `run` call retried); the buffer hands
its leased prompts out again, so nothing drawn is lost or delivered twice.

On a KubeRay cluster the actors run on the worker pods, not the task's: each fetches what it reads
(policy, checkpoint, reference) and the trainer stores what it writes through `spec.transfer` (the
object store), and each actor is pinned to its worker group (`placement`).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

import torch

from miles_core.async_buffer import SampleBuffer, StalenessGate, phase_summary
from miles_core.async_rollout import AsyncPhaseError, RolloutWorker, actor_threads, spec_fns
from miles_core.config import AlgoConfig, AsyncConfig, HealthConfig, HooksConfig, PublishConfig, RewardConfig, RolloutConfig, TrainConfig
from miles_core.data.source import DataState, Prompt
from miles_core.plugins import plugin
from miles_core.samples import Sample
from miles_core.step import score_batch, train_step
from miles_core.storage import Transfer
from miles_core.train.backends import load_trainer, make_trainer
from miles_core.weights.publish import publish
from miles_core.weights.quantize import fake_quantized

ROLLOUT_ACTOR = "miles-rollout-{}"  # Ray actor names (a test kills one mid-phase by name)
# Ray custom resources that the worker groups of the phase's KubeRay cluster declare (tasks/async_phase.py), one per pod
ROLLOUT_GROUP, TRAINER_GROUP = "miles_rollout", "miles_trainer"


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


class AsyncTrainer:
    """A Ray actor holding the policy being optimised, with either backend (and the KL reference when
    algo.kl_coef > 0). It is one process: megatron runs in a world of one (gloo on CPU)."""

    def __init__(self, spec: PhaseSpec):
        from miles_core.models.tokenizers import load_tokenizer

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
        self.tokenizer = load_tokenizer(self.ckpt_dir)

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
        ray.get(buffer.weights_loaded.remote(self.version))
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
    gate = StalenessGate(cfg.max_staleness, spec.rollout.prompts_per_step, weights_version=spec.version, next_take=spec.version)
    buffer = ray.remote(SampleBuffer).options(num_cpus=0).remote(spec.prompts, source, cfg.queue_size, cfg.stale_policy, take_fn, spec.waiting, gate)
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
