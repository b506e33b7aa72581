"""The async phase's bounded, leased buffer, its schedule and its rollout actors' lease count, without Ray (plain Python objects)."""

import pytest

from miles_core.algos.filters import oldest_first
from miles_core.async_buffer import SampleBuffer, StalenessGate, draw_of
from miles_core.async_rollout import scoring_leases
from miles_core.config import AsyncConfig, ConfigError, RewardConfig, RunConfig
from miles_core.data.source import DataState, Prompt, PromptSource
from miles_core.samples import Sample

PROMPTS = [Prompt(id=f"p{i}", text=f"{i}+1=", label=str(i + 1)) for i in range(5)]


def buffer(capacity=4, policy="drop", waiting=()):
    return SampleBuffer(PROMPTS, PromptSource(PROMPTS, seed=0), capacity, policy, oldest_first, list(waiting))


def group(prompt: Prompt, version: int, n=2):
    return [Sample(prompt.id, i, [1], [2], [-0.5], [1], "stop", version, prompt.label, dict(prompt.metadata), 1.0) for i in range(n)]


def test_draws_are_numbered_by_stream_position_and_the_bound_holds():
    b = buffer(capacity=4)
    first = b.lease(0, 3)
    assert [p.metadata["draw"] for p in first] == [0, 1, 2]
    assert [p.metadata["draw"] for p in b.lease(1, 3)] == [3]  # 3 leased + 1 = capacity
    assert b.lease(2, 1) == []  # full: the rollout actor waits
    b.deliver(0, [group(p, 1) for p in first], {"samples": 6})
    assert b.lease(2, 1) == []  # delivered groups still count until the trainer takes them
    taken, depth = b.take(3, min_version=0)
    assert len(taken) == 3 and depth == 3
    assert [p.metadata["draw"] for p in b.lease(2, 5)] == [4, 5, 6]  # into the next epoch: positions keep counting
    assert b.drain()["state"] == DataState(epoch=1, offset=2)


def test_draws_dropped_by_dynamic_sampling_end_the_lease_and_are_counted():
    b = buffer()
    b.register(0)
    leased = b.lease(0, 3)
    b.deliver(0, [group(leased[1], 1)], {}, filtered=[leased[0].metadata["draw"], leased[2].metadata["draw"]])
    drained = b.drain()
    assert [g[0].metadata["draw"] for g in drained["groups"]] == [1] and drained["filtered"] == [0, 2]  # draws 0..2, as leased
    b.close()
    assert b.settled()  # nothing leased or waiting: the filtered draws are not handed out again


def test_a_restarted_actor_gets_its_lease_handed_out_again():
    b = buffer()
    b.register(0)
    lost = b.lease(0, 2)
    b.set_latest_weights(("weights", 3))
    assert b.register(0) == ("weights", 3)  # the restart starts from the newest weights
    again = b.lease(1, 2)
    assert [p.metadata["draw"] for p in again] == [p.metadata["draw"] for p in lost]
    with pytest.raises(RuntimeError, match="delivered draws \\[0\\] \\(filtered \\[\\]\\), none of its leases \\[\\[0, 1\\]\\]"):
        b.deliver(1, [group(again[0], 1)], {})
    assert b.drain()["restarts"] == 1


def test_an_actor_holds_several_leases_each_delivered_whole_in_any_order():
    b = buffer(capacity=5)
    b.register(0)
    first, second = b.lease(0, 2), b.lease(0, 2)  # the next lease is generated while the first is scored
    assert [p.metadata["draw"] for p in first + second] == [0, 1, 2, 3]
    assert [p.metadata["draw"] for p in b.lease(1, 3)] == [4]  # both leases count against the bound
    with pytest.raises(RuntimeError, match="none of its leases \\[\\[0, 1\\], \\[2, 3\\]\\]"):
        b.deliver(0, [group(first[1], 1), group(second[0], 1)], {})  # one lease at a time, whole
    b.deliver(0, [group(p, 1) for p in second], {})
    b.register(0)  # a restart hands out again the lease still held, not the delivered one
    assert [p.metadata["draw"] for p in b.lease(1, 2)] == [0, 1]


def test_stale_groups_are_dropped_or_regenerated():
    dropping, regenerating = buffer(policy="drop"), buffer(policy="regenerate")
    for b in (dropping, regenerating):
        prompts = b.lease(0, 2)
        b.deliver(0, [group(prompts[0], 1), group(prompts[1], 3)], {})
        assert b.take(2, min_version=2) == (None, 1)  # one fresh group only
    assert dropping.drain()["dropped"] == ["0/0", "0/1"]
    assert [p.metadata["draw"] for p in regenerating.lease(1, 1)] == [0]  # generated again, same draw


def test_closing_stops_new_draws_but_finishes_what_was_drawn():
    b = buffer(waiting=[group(PROMPTS[4], 0)])
    leased = b.lease(0, 1)
    b.close()
    assert not b.settled()
    assert b.lease(1, 1) is None  # nothing left to hand out
    b.deliver(0, [group(leased[0], 1)], {})
    assert b.settled()
    drained = b.drain()
    assert [draw_of(g) for g in drained["groups"]] == [-1, 0] and drained["state"] == DataState(0, 1)


@pytest.mark.parametrize(
    "values, key",
    [
        ({"update_weights_interval": 3, "max_staleness": 1}, "async_phase.max_staleness"),
        ({"stale_policy": "keep"}, "async_phase.stale_policy"),
        ({"schedule": "sometimes"}, "async_phase.schedule"),
        ({"sync_iterations": 2}, "async_phase.sync_iterations"),
        ({"push_timeout_s": 0}, "async_phase.push_timeout_s"),
    ],
)
def test_bad_async_settings_name_their_key(values, key):
    with pytest.raises(ConfigError, match=key):
        AsyncConfig(**values)


def test_queue_must_hold_a_step():
    with pytest.raises(ConfigError, match="async_phase.queue_size: must be >= rollout.prompts_per_step"):
        RunConfig(async_phase=AsyncConfig(schedule="async", queue_size=8, prompts_per_lease=4))


@pytest.mark.parametrize(
    "concurrency, lease_samples, held",
    [
        (8, 16, 2),  # a lease fills the slots: one scored while the next is generated
        (8, 8, 2),
        (32, 8, 5),  # four leases fill 32 slots, a fifth waits for the slowest requests' slots
        (30, 8, 5),
        (1, 4, 2),
    ],
)
def test_a_rollout_actor_holds_enough_leases_to_fill_its_reward_request_slots(concurrency, lease_samples, held):
    assert scoring_leases(RewardConfig(remote_concurrency=concurrency), lease_samples) == held


def test_the_gate_leases_only_groups_the_trainer_takes_within_the_staleness_bound():
    gate = StalenessGate(max_staleness=1, step_groups=2, weights_version=0, next_take=0)
    b = SampleBuffer(PROMPTS, PromptSource(PROMPTS, seed=0), 10, "drop", oldest_first, [], gate)
    first = b.lease(0, 5)
    assert len(first) == 4  # version-0 groups are taken at versions 0 and 1: two steps' worth
    assert b.lease(1, 1) == []  # a fifth would wait for the trainer at version 2
    b.deliver(0, [group(p, 0) for p in first], {})
    taken, _ = b.take(2, min_version=-1)  # the trainer trains at version 0
    assert len(taken) == 2 and b.lease(1, 1) == []  # the version-0 weights are still the engines'
    b.set_latest_weights(([], 1))  # the trainer pushes version 1
    assert b.lease(1, 1) == []  # until every actor has loaded it, a lease may be generated with version 0
    b.weights_loaded(1)
    assert len(b.lease(1, 5)) == 2  # taken at version 2 at the latest: within the bound of version 1
    taken, _ = b.take(2, min_version=0)
    assert {s.weight_version for g in taken for s in g} == {0} and not b.dropped  # nothing generated was too stale
