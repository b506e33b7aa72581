"""The bounded queue of the asynchronous phase, with leases so that no sample is lost or counted twice.

One `SampleBuffer` (a Ray actor in async_loop.py, plain Python here so it is testable alone)
owns the prompt stream and every group between "drawn from the stream" and "consumed by the
trainer". A rollout actor leases prompts, generates and scores them, and delivers the groups;
delivery ends the lease in the same call, so an actor that dies holding a lease never delivers
half of it: when Ray restarts the actor, `register` hands its leased prompts out again. An actor
may hold several leases (it generates the next while the last is being scored); each is
delivered whole, on its own.

Every prompt draw carries its stream position (`metadata["draw"]`, epoch * len(prompts) +
offset), so across phases each draw ends exactly once: consumed by a training step, dropped as
too stale (policy "drop"), dropped by dynamic sampling (rollout.dynamic_filter_fn), or still
waiting in the buffer handed to the next phase.

Bound: groups ready plus prompts leased never exceed `capacity`; a full buffer leases nothing
(the rollout actor waits), which is what keeps a fast rollout from running far ahead. With a
`StalenessGate` the buffer also leases only what the trainer will take within the staleness bound.
`phase_summary` turns a phase's consumed batches and the buffer's drained counts into its totals.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter

from miles_core.data.source import DataState, Prompt
from miles_core.samples import Sample

Group = list[Sample]


def draw_of(group_or_sample) -> int:
    sample = group_or_sample[0] if isinstance(group_or_sample, list) else group_or_sample
    return int(sample.metadata.get("draw", -1))


def group_version(group: Group) -> int:
    """The oldest weight version that produced any of the group's samples."""
    return min(s.weight_version for s in group)


@dataclasses.dataclass
class StalenessGate:
    """Staleness-aware admission (AReaL's): a group leased now is generated with the weights every actor has loaded
    (or newer) and taken by the trainer, oldest first, after the `queued` groups ahead of it, at version next_take +
    queued // step_groups. It is leased only if that version is within max_staleness of those weights, so no rollout
    actor spends its core on a group that the staleness bound would drop."""

    max_staleness: int
    step_groups: int  # rollout.prompts_per_step: groups per training step
    weights_version: int  # the weights every rollout actor has loaded (the phase's start version at first)
    next_take: int  # the trainer's version at its next take

    def room(self, queued: int) -> int:
        return (self.weights_version + self.max_staleness + 1 - self.next_take) * self.step_groups - queued


def stream_position(state: DataState, n_prompts: int) -> int:
    return state.epoch * n_prompts + state.offset


class SampleBuffer:
    """prompts: the dataset (to rebuild the prompt of a group to regenerate); source: the
    data.source_fn stream; waiting: scored groups left by the previous phase; take_fn: the
    rollout.buffer_filter_fn plug-point choosing which ready groups a step takes."""

    def __init__(self, prompts: list[Prompt], source, capacity: int, stale_policy: str, take_fn, waiting: list[Group] = (), gate: StalenessGate | None = None):
        self._by_id = {p.id: p for p in prompts}
        self._n_prompts = len(prompts)
        self._source = source
        self._capacity = capacity
        self._gate = gate
        self._stale_policy = stale_policy
        self._take_fn = take_fn
        self._ready: list[Group] = list(waiting)
        self._reissue: list[Prompt] = []  # drawn prompts to generate (again): dead actors' leases, stale groups
        self._leases: dict[int, list[list[Prompt]]] = {}  # worker -> its leases being generated or scored
        self._closed = False
        self._latest_weights = None  # ([ObjectRef of the state dict], version) of the last push
        self.dropped: list[str] = []  # "draw/index" of samples dropped as too stale
        self.filtered: list[int] = []  # draws whose group dynamic sampling dropped
        self.registrations: Counter = Counter()
        self.rollout_stats: Counter = Counter()  # summed over deliveries: samples, tokens, busy/idle seconds

    # rollout side -------------------------------------------------------------------------------
    def register(self, worker: int):
        """A rollout actor (re)starts: its unfinished leases are handed out again; returns the latest weights."""
        self.registrations[worker] += 1
        self._reissue = [p for lease in self._leases.pop(worker, []) for p in lease] + self._reissue
        return self._latest_weights

    def lease(self, worker: int, n: int) -> list[Prompt] | None:
        """Up to n prompts for `worker` ([] while the buffer is full); None once closed with nothing left."""
        queued = len(self._ready) + sum(len(lease) for leases in self._leases.values() for lease in leases)
        room = self._capacity - queued if self._gate is None else min(self._capacity - queued, self._gate.room(queued))
        take = min(n, room)
        if take <= 0:
            return None if self._closed and not self._reissue else []
        prompts, self._reissue = self._reissue[:take], self._reissue[take:]
        if len(prompts) < take and not self._closed:
            prompts += self._draw(take - len(prompts))
        if not prompts:
            return None if self._closed else []
        self._leases.setdefault(worker, []).append(prompts)
        return prompts

    def _draw(self, n: int) -> list[Prompt]:
        start = stream_position(self._source.state, self._n_prompts)
        drawn = self._source.next_batch(n)
        return [dataclasses.replace(p, metadata={**p.metadata, "draw": start + i}) for i, p in enumerate(drawn)]

    def deliver(self, worker: int, groups: list[Group], stats: dict[str, float], filtered: list[int] = ()) -> None:
        """The groups of one of `worker`'s leases, generated and scored, and the draws whose groups
        rollout.dynamic_filter_fn dropped (they end there, like a consumed group); ends that lease."""
        leases = self._leases.get(worker, [])
        leased = [sorted(p.metadata["draw"] for p in lease) for lease in leases]
        delivered = sorted(draw_of(g) for g in groups)
        if sorted(delivered + list(filtered)) not in leased:
            raise RuntimeError(f"rollout actor {worker} delivered draws {delivered} (filtered {sorted(filtered)}), none of its leases {leased}")
        del leases[leased.index(sorted(delivered + list(filtered)))]
        if not leases:
            del self._leases[worker]
        self._ready += groups
        self.filtered += sorted(filtered)
        self.rollout_stats.update(stats)

    def set_latest_weights(self, weights) -> None:
        """The weights being pushed: an actor (re)starting from now on loads these."""
        self._latest_weights = weights

    def weights_loaded(self, version: int) -> None:
        """Every rollout actor acknowledged `version`: leases from now on are generated with it. Until then a lease
        may be generated with the weights before, so the gate admits by those."""
        if self._gate is not None:
            self._gate.weights_version = version

    # trainer side -------------------------------------------------------------------------------
    def take(self, n: int, min_version: int) -> tuple[list[Group] | None, int]:
        """(n groups no older than min_version, or None if fewer are ready; the queue depth before
        taking); older groups are dropped or regenerated first."""
        self._evict_older_than(min_version)
        depth = len(self._ready)
        if depth < n:
            return None, depth
        taken, self._ready = self._take_fn(self._ready, n)
        if self._gate is not None:  # the trainer trains at min_version + max_staleness, then takes at the next version
            self._gate.next_take = min_version + self._gate.max_staleness + 1
        return taken, depth

    def _evict_older_than(self, min_version: int) -> None:
        stale = [g for g in self._ready if group_version(g) < min_version]
        if not stale:
            return
        self._ready = [g for g in self._ready if group_version(g) >= min_version]
        if self._stale_policy == "regenerate":
            self._reissue += [self._prompt_of(g) for g in stale]
        else:
            self.dropped += [f"{draw_of(s)}/{s.index}" for g in stale for s in g]

    def _prompt_of(self, group: Group) -> Prompt:
        sample = group[0]
        prompt = self._by_id[sample.prompt_id]
        return dataclasses.replace(prompt, metadata={**prompt.metadata, "draw": draw_of(sample)})

    # end of the phase ---------------------------------------------------------------------------
    def close(self) -> None:
        """No new draws from the stream; prompts already drawn are still generated."""
        self._closed = True

    def settled(self) -> bool:
        """Closed, and every drawn prompt is a ready group (nothing leased or waiting to be generated)."""
        return self._closed and not self._reissue and not self._leases

    def drain(self) -> dict:
        """What the next phase needs and what this one measured; the buffer is empty afterwards."""
        ready, self._ready = self._ready, []
        return {
            "groups": ready,
            "state": self._source.state,
            "dropped": list(self.dropped),
            "filtered": list(self.filtered),
            "restarts": sum(self.registrations.values()) - len(self.registrations),
            "rollout": dict(self.rollout_stats),
        }


def phase_summary(consumed: list[list[Sample]], steps: list[dict], drained: dict, train_s: float) -> dict[str, float]:
    """Phase totals over the trainer's run (from its first take, actors' start-up excluded):
    throughput, staleness distribution, queue depth, idle times, restarts, drops."""
    samples = [s for batch in consumed for s in batch]
    staleness = Counter(s.metadata["trainer_version"] - s.weight_version for s in samples)
    rollout, depths = drained["rollout"], [m["async/queue_depth"] for m in steps]
    return {
        "async/samples_per_s": len(samples) / train_s,
        "async/tokens_per_s": sum(len(s.response_tokens) for s in samples) / train_s,
        "async/generated_samples_per_s": rollout.get("samples", 0) / train_s,
        "async/generated_tokens_per_s": rollout.get("tokens", 0) / train_s,
        "async/rollout_busy_s": rollout.get("busy_s", 0.0),
        "async/rollout_score_s": rollout.get("score_s", 0.0),
        "async/rollout_idle_s": rollout.get("idle_s", 0.0),
        "async/queue_depth_mean": statistics.fmean(depths),
        "async/queue_depth_max": float(max(depths)),
        "async/phase_staleness_mean": sum(k * v for k, v in staleness.items()) / max(len(samples), 1),
        **{f"async/staleness_{k}_fraction": v / len(samples) for k, v in sorted(staleness.items())},
        "async/dropped_samples": float(len(drained["dropped"])),
        "async/filtered_groups": float(len(drained["filtered"])),
        "async/buffered_groups": float(len(drained["groups"])),
        "async/actor_restarts": float(drained["restarts"]),
        "time/async_train_s": train_s,
    }
