"""The dashboard's collector on the in-memory bus and state store: what each topic and heartbeat adds,
staleness paired by log time whatever order records are read in, lag per group, bounded history."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.replay import Bound
from rlbus.bus.topic import Topic
from rlbus.bus.topics import REWARDS, ROLLOUTS, WEIGHTS, topic_specs
from rlbus.bus.types import Record
from rlbus.observe.collector import Collector, Limits
from rlbus.schemas import Reward, Rollout, TensorData, WeightVersion
from rlbus.state.memory import MemoryStateStore
from rlbus.state.progress import VERSION_COUNTER


def rollout(rid: str, versions: list[int], *, worker: str = "rollout-0", region: str = "eu-west",
            created_at: float = 0.0) -> Rollout:
    n = len(versions)
    mask = np.array([int(v >= 0) for v in versions], dtype=np.uint8)
    return Rollout(
        rollout_id=rid, prompt_id=f"p-{rid}", group_index=0, group_size=1, worker_id=worker, region=region,
        token_ids=TensorData.from_numpy(np.zeros(n, dtype=np.int32)),
        loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.zeros(n, dtype=np.float32)),
        token_versions=TensorData.from_numpy(np.array(versions, dtype=np.int32)),
        created_at=created_at,
    )


def manifest(version: int, kind: str = "delta", encoded: int = 1000, full: int = 50_000) -> WeightVersion:
    return WeightVersion(
        model_id="policy", version=version, base_version=version - 1 if kind == "delta" else None,
        kind=kind,  # type: ignore[arg-type]
        keyframe_version=1, dtype="bfloat16", chunks=[], tensors=[], model_digest="d", full_bytes=full,
        encoded_bytes=encoded,
    )


def reward(rid: str, source: str, value: float, created_at: float) -> Reward:
    return Reward(reward_id=f"r-{rid}-{source}", rollout_id=rid, prompt_id=f"p-{rid}", source=source, value=value,
                  created_at=created_at)


def record(topic: Topic[Any], message: Any, t: float, offset: int = 0) -> Record[Any]:
    key, raw = topic.encode(message)
    return Record(topic=topic.name, partition=0, offset=offset, timestamp_ms=int(t * 1000), key=key, raw=raw,
                  decoder=topic.codec)


# (log time, message) of a small run: v1 at t=100, v2 at t=200 (a keyframe too), rollouts around them.
RUN: list[tuple[Topic[Any], Any, float]] = [
    (ROLLOUTS, rollout("a", [0, 0]), 50.0),  # before any manifest: its own newest version (0) is the trainer's
    (WEIGHTS, manifest(1, "keyframe", encoded=48_000), 100.0),
    (ROLLOUTS, rollout("b", [0, 0], created_at=119.0), 120.0),  # oldest 0 while v1 is out: 1 behind
    (ROLLOUTS, rollout("c", [-1, 1, 1], worker="rollout-1", region="us-east"), 150.0),  # 0 behind
    (WEIGHTS, manifest(2, "delta", encoded=900), 200.0),
    (WEIGHTS, manifest(2, "keyframe", encoded=47_000), 200.5),
    (ROLLOUTS, rollout("d", [1, 2], created_at=249.0), 250.0),  # oldest 1 while v2 is out: 1 behind
    (ROLLOUTS, rollout("e", [-1, 1], worker="rollout-1", region="us-east"), 260.0),  # 1 behind
    (REWARDS, reward("b", "verifier", 1.0, 130.0), 130.0),
    (REWARDS, reward("c", "verifier", 0.0, 160.0), 160.0),
    (REWARDS, reward("c", "judge", 0.5, 161.0), 161.0),
]


def ingest_run(order: list[int]) -> Collector:
    collector = Collector(bus=MemoryBus())
    collector.ingest(record(RUN[i][0], RUN[i][1], RUN[i][2], offset=i) for i in order)
    return collector


def test_staleness_pairs_each_rollout_with_the_version_out_when_it_arrived_in_any_read_order() -> None:
    forward = ingest_run(list(range(len(RUN))))
    backward = ingest_run(list(reversed(range(len(RUN)))))
    assert forward.staleness() == backward.staleness() == {0: 2, 1: 3}
    assert forward.snapshot()["staleness"] == {"0": 2, "1": 3}


def test_snapshot_has_every_series_the_page_draws() -> None:
    snap = ingest_run(list(range(len(RUN)))).snapshot()
    assert snap["counts"] == {"rewards": 3, "rollouts": 5, "weights": 3, "unreadable": 0, "claimed": 0}
    assert [p[1] for p in snap["rewards"]["verifier"]] == [1.0, 0.0]
    assert [p[1] for p in snap["rewards"]["judge"]] == [0.5]
    assert snap["weights"] == [
        {"version": 1, "t": 100.0, "full_bytes": 50_000, "keyframe_bytes": 48_000},
        {"version": 2, "t": 200.0, "full_bytes": 50_000, "delta_bytes": 900, "keyframe_bytes": 47_000},
    ]
    assert snap["versions"]["trainer"] == [[100.0, 1], [200.0, 2]]  # one point per version, not per manifest
    assert snap["versions"]["rollout-0"] == [[50.0, 0], [119.0, 0], [249.0, 2]]
    assert snap["versions"]["rollout-1"] == [[150.0, 1], [260.0, 1]]
    assert snap["regions"] == {"rollout-0": "eu-west", "rollout-1": "us-east"}
    assert snap["trainer"] == {"version": 2, "published": 2, "step": None}


def test_other_models_on_the_same_topics_are_ignored() -> None:
    collector = ingest_run(list(range(len(RUN))))
    other_manifest = manifest(9)
    other_manifest.model_id = "judge"
    other_rollout = rollout("z", [9, 9])
    other_rollout.model_id = "judge"
    collector.ingest([record(WEIGHTS, other_manifest, 300.0), record(ROLLOUTS, other_rollout, 310.0)])
    assert collector.snapshot()["trainer"]["published"] == 2
    assert collector.staleness() == {0: 2, 1: 3}


def test_a_worker_on_one_version_keeps_only_its_first_and_latest_sighting() -> None:
    collector = Collector(bus=MemoryBus())
    for t in range(10):
        collector.add_worker_version("w", 3, float(t))
    collector.add_worker_version("w", 4, 10.0)
    assert list(collector.worker_versions["w"]) == [(0.0, 3), (9.0, 3), (10.0, 4)]


def test_an_unreadable_record_is_counted_and_skipped() -> None:
    collector = Collector(bus=MemoryBus())
    bad: Record[Any] = Record(topic=REWARDS.name, partition=0, offset=0, timestamp_ms=0, key=None, raw=b"\xc1junk",
                 decoder=REWARDS.codec)
    claim: Record[Any] = Record(topic=ROLLOUTS.name, partition=0, offset=0, timestamp_ms=0, key=None, raw=b"",
                                headers=(("rlbus.claim", b'{"key": "claims/x"}'),), decoder=ROLLOUTS.codec)
    collector.ingest([bad, claim, record(REWARDS, reward("x", "user", 1.0, 5.0), 5.0)])
    assert collector.counts["unreadable"] == 1 and collector.counts["claimed"] == 1
    assert collector.counts["rewards"] == 1


def test_history_is_bounded() -> None:
    collector = Collector(bus=MemoryBus(), limits=Limits(points=5, rollouts=3, reward_bins=2))
    for i in range(20):
        collector.add_reward("verifier", float(i), float(i))
        collector.add_rollout(rollout(str(i), [i]), float(i))
    assert len(collector.rewards["verifier"]) == 5
    assert len(collector.arrivals) == 3
    binned = collector.snapshot()["rewards"]["verifier"]
    assert len(binned) == 2 and sum(p[2] for p in binned) == 5  # [mean time, mean value, count] per bin


async def test_heartbeats_add_versions_swap_pauses_hacks_and_trainer_steps_once_each() -> None:
    bus = MemoryBus(topic_specs(partitions=2))
    await bus.start()
    state = MemoryStateStore()
    collector = Collector(bus=bus, state=state)
    # The shapes of RolloutWorker/WeightSync.stats() and TrainerWorker.stats() (rlbus.observe.heartbeat).
    await state.heartbeat("rollout", "rollout-0", {"region": "eu-west", "version": 3, "syncs": 5,
                                                   "swap_pause_ms": [0.5, 0.7, 0.9]}, ttl_s=30)
    last_step = {"kl_k3": 2e-3, "max_abs_dlogprob": 0.4, "is_ess": 0.97, "router_flip_rate": None, "reward_mean": 0.5,
                 "hacked": 0.25}
    await state.heartbeat("trainer", "trainer-0", {"step": 4, "version": 5, "last_step": last_step}, ttl_s=30)
    # RewardWorker.stats(): one worker found hacking, the other nothing (no entry for it on the dashboard)
    await state.heartbeat("reward", "reward-0", {"hacks": {"exit": 3, "always_equal": 1, "introspection": 0},
                                                 "hack_policy": "zero"}, ttl_s=30)
    await state.heartbeat("reward", "reward-1", {"hacks": {}, "hack_policy": "flag"}, ttl_s=30)
    await state.incr(VERSION_COUNTER, 5)
    await collector.poll_once()
    await state.heartbeat("rollout", "rollout-0", {"region": "eu-west", "version": 4, "syncs": 6,
                                                   "swap_pause_ms": [0.7, 0.9, 1.1]}, ttl_s=30)
    await collector.poll_once()
    snap = collector.snapshot()
    assert [(v, ms) for _, v, ms in snap["swaps"]["rollout-0"]] == [(None, 0.5), (None, 0.7), (3, 0.9), (4, 1.1)]
    assert [s["step"] for s in snap["steps"]] == [4]
    assert snap["steps"][0]["kl_k3"] == 2e-3 and snap["steps"][0]["router_flip_rate"] is None
    assert snap["steps"][0]["hacked"] == 0.25
    assert snap["hacks"] == {"reward-0": {"kinds": {"exit": 3, "always_equal": 1}, "policy": "zero"}}
    assert [v for _, v in snap["versions"]["rollout-0"]] == [3, 4]
    assert snap["trainer"]["version"] == 5
    assert {w["worker_id"]: w["region"] for w in snap["workers"]} == {
        "rollout-0": "eu-west", "trainer-0": "", "reward-0": "", "reward-1": ""}
    # The demo feeds the same swaps by their history index: nothing is counted twice.
    collector.add_swap("rollout-0", 5, 0.0011, 0.0, 4)
    assert len(collector.swaps["rollout-0"]) == 4


async def test_lag_is_end_minus_committed_per_group_and_skips_groups_that_never_committed() -> None:
    bus = MemoryBus(topic_specs(partitions=2))
    await bus.start()
    for i in range(6):
        await bus.send(REWARDS, reward(str(i), "verifier", 1.0, 0.0))
    async with bus.consumer([REWARDS], group="trainer") as consumer:
        records = await consumer.getmany(timeout_s=0.1, max_records=100)
        for r in sorted(records, key=lambda r: (r.partition, r.offset))[:4]:
            consumer.mark(r)
        await consumer.commit()
    collector = Collector(bus=bus)
    await collector.poll_once()
    lag = collector.snapshot()["lag"]
    assert list(lag) == ["rl.rewards.v1 ← trainer"]  # rollouts ← trainer / reward-verifier never committed
    assert lag["rl.rewards.v1 ← trainer"][-1][1] == 6 - 4


async def test_run_follows_the_topics_live_from_the_start_bound() -> None:
    bus = MemoryBus(topic_specs(partitions=2))
    await bus.start()
    await bus.send(REWARDS, reward("old", "verifier", 0.0, 1.0), timestamp_ms=1_000)
    await bus.send(REWARDS, reward("new", "verifier", 1.0, 2.0), timestamp_ms=2_000)
    collector = Collector(bus=bus, start=Bound(time_ms=1_500), poll_s=0.05)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(collector.run(stop))
        await bus.send(WEIGHTS, manifest(1, "keyframe"))
        await bus.send(ROLLOUTS, rollout("live", [1, 1]))
        await until(lambda: collector.counts["rollouts"] and collector.counts["weights"], "the rollout and manifest")
        stop.set()
    assert collector.counts == {"rewards": 1, "rollouts": 1, "weights": 1, "unreadable": 0, "claimed": 0}
    assert [p[1] for p in collector.snapshot()["rewards"]["verifier"]] == [1.0]
    assert collector.error is None


async def test_a_missing_topic_is_reported_not_raised() -> None:
    bus = MemoryBus()  # no topics created
    await bus.start()
    collector = Collector(bus=bus, poll_s=0.05)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(collector.run(stop))
        await until(lambda: collector.error, "the missing topic reported")
        stop.set()
    assert collector.error is not None and "does not exist" in collector.error
