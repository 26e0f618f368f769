"""The metrics registry, the /metrics endpoint, the lag probes, and the workers' instrumentation."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import torch

from rlbus import metrics as m
from rlbus.aio import until
from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus, TopicPartition, TopicSpec
from rlbus.bus.dlq import read_dead_letters
from rlbus.bus.topics import ROLLOUTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.envs.agent import reference_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.tasks import generate_prompts
from rlbus.observe.lag import LagProbe
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync

ROOT = Path(__file__).resolve().parents[2]
METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"


def value(name: str, **labels: str) -> float:
    return m.REGISTRY.get_sample_value(name, labels) or 0.0


def test_every_metric_is_documented_and_the_docs_table_is_generated_from_them() -> None:
    defined = m.rlbus_metrics()
    names = {metric._name for metric in defined}
    for required in (
        "rlbus_messages_in", "rlbus_messages_out", "rlbus_consumer_lag", "rlbus_processing_seconds",
        "rlbus_dead_letters", "rlbus_policy_version", "rlbus_rollout_staleness_versions",
        "rlbus_weight_sync_bytes", "rlbus_weight_sync_stage_seconds", "rlbus_weight_swap_pause_seconds",
        "rlbus_reward", "rlbus_trainer_kl_k3", "rlbus_trainer_router_flip_rate", "rlbus_trainer_is_ess",
        "rlbus_trainer_step_seconds", "rlbus_event_loop_lag_seconds",
    ):
        assert required in names
    assert all(metric._documentation.strip() for metric in defined)
    assert m.metrics_table() in METRICS_PAGE.read_text(), f"{METRICS_PAGE} is stale: run `make docs`"


async def test_serve_metrics_serves_the_text_exposition() -> None:
    topic = f"t.{uuid.uuid4().hex[:6]}"
    m.MESSAGES_IN.labels(topic).inc(3)
    async with m.serve_metrics(0) as server, aiohttp.ClientSession() as http:
        assert server.port > 0
        async with http.get(server.url) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = await response.text()
    assert f'rlbus_messages_in_total{{topic="{topic}"}} 3.0' in body
    assert "# HELP rlbus_weight_swap_pause_seconds" in body
    assert "process_cpu_seconds_total" in body or "python_info" in body


async def test_loop_lag_monitor_sees_a_blocked_loop() -> None:
    before = value("rlbus_event_loop_lag_seconds_count")
    monitor = m.LoopLagMonitor(interval_s=0.01)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(monitor.run(stop))
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 - blocks the loop on purpose, as a hash or model step on it would
        await asyncio.sleep(0.05)
        stop.set()
    assert monitor.max_s >= 0.25
    assert value("rlbus_event_loop_lag_seconds_count") > before
    assert monitor.stats()["loop_lag_ms_max"] >= 250
    assert monitor.stats()["loop_lag_ms_max"] < 250  # the window restarts after each read


async def test_lag_probe_reports_owned_partitions_and_drops_moved_ones() -> None:
    bus = MemoryBus([TopicSpec("probe.t", partitions=2)])
    await bus.start()
    for p, n in ((0, 3), (1, 5)):
        for i in range(n):
            await bus.send_raw("probe.t", b"%d" % i, partition=p)
    group = f"g-{uuid.uuid4().hex[:6]}"
    now = [0.0]
    probe = LagProbe(every_s=5.0, clock=lambda: now[0])
    async with bus.consumer(["probe.t"], group=group) as first:
        assert await probe.refresh(first) == {TopicPartition("probe.t", 0): 3, TopicPartition("probe.t", 1): 5}
        assert value("rlbus_consumer_lag", topic="probe.t", partition="1", group=group) == 5
        assert probe.total == 8
        async with bus.consumer(["probe.t"], group=group) as second:  # rebalance: first keeps partition 0
            await bus.send_raw("probe.t", b"x", partition=0)
            assert await probe.refresh(first) == {TopicPartition("probe.t", 0): 3, TopicPartition("probe.t", 1): 5}
            now[0] = 6.0  # the interval passed: the probe asks again
            assert await probe.refresh(first) == {TopicPartition("probe.t", 0): 4}
            assert m.REGISTRY.get_sample_value(
                "rlbus_consumer_lag", {"topic": "probe.t", "partition": "1", "group": group}
            ) is None
            assert second.assignment() == {TopicPartition("probe.t", 1)}


def test_record_step_sets_trainer_figures() -> None:
    stale_before = value("rlbus_rollout_staleness_versions_count")
    two_behind = value("rlbus_rollout_staleness_versions_bucket", le="2.0")
    m.record_step({"step": 7, "version": 3, "step_s": 0.5, "kl_k3": 0.01, "is_ess": 0.9, "router_flip_rate": None,
                   "staleness": {0: 5, 2: 3}, "rollouts": 8, "tokens": 100})
    m.record_step({"step": 8, "version": 3, "kl_k3": float("nan")})
    assert value("rlbus_trainer_step") == 8
    assert value("rlbus_trainer_version") == 3
    assert value("rlbus_trainer_kl_k3") == 0.01  # NaN leaves the last finite value
    assert value("rlbus_trainer_is_ess") == 0.9
    assert value("rlbus_rollout_staleness_versions_count") - stale_before == 8
    assert value("rlbus_rollout_staleness_versions_bucket", le="2.0") - two_behind == 8


async def test_reward_worker_counts_messages_dead_letters_latency_and_rewards() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    chat = ChatFormat.for_byte_tokenizer()
    prompts = generate_prompts("arith", seed=3, n=2)
    for prompt in prompts:
        episode = await reference_episode(env_for(prompt), prompt, chat=chat)  # type: ignore[arg-type]
        await bus.send(ROLLOUTS, episode_to_rollout(episode, prompt=prompt, group_index=0))
    good = episode_to_rollout(episode, prompt=prompts[-1], group_index=1)
    await bus.send(ROLLOUTS, msgspec.structs.replace(good, rollout_id="no-prompt", prompt=None))

    before = {
        "in": value("rlbus_messages_in_total", topic=ROLLOUTS.name),
        "out": value("rlbus_messages_out_total", topic="rl.rewards.v1"),
        "dlq": value("rlbus_dead_letters_total", topic=ROLLOUTS.name, reason="MalformedMessage"),
        "latency": value("rlbus_processing_seconds_count", role="reward"),
        "reward": value("rlbus_reward_count", source="verifier"),
    }
    worker = RewardWorker(bus=bus, worker_id="reward-m")
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(worker.run(stop))
        await until(lambda: worker.scored == 2 and sum(worker.dead_letters.counts.values()) == 1,
                    "two rollouts scored and one dead-lettered")
        stop.set()
    assert len(await read_dead_letters(bus, ROLLOUTS.name)) == 1
    assert value("rlbus_messages_in_total", topic=ROLLOUTS.name) - before["in"] == 3
    assert value("rlbus_messages_out_total", topic="rl.rewards.v1") - before["out"] == 2
    assert value("rlbus_dead_letters_total", topic=ROLLOUTS.name, reason="MalformedMessage") - before["dlq"] == 1
    assert value("rlbus_processing_seconds_count", role="reward") - before["latency"] == 2
    assert value("rlbus_reward_count", source="verifier") - before["reward"] == 2
    stats = worker.stats()
    assert stats["processed"] == 2 and stats["dead_letters"] == 1 and stats["group"] == "reward-verifier"
    assert value("rlbus_consumer_lag", topic=ROLLOUTS.name, partition=str(good_partition(bus)),
                 group="reward-verifier") >= 0


def good_partition(bus: MemoryBus) -> int:
    return next(p for p, entries in enumerate(bus._logs[ROLLOUTS.name].partitions) if entries)


async def test_publish_and_sync_record_bytes_pauses_and_versions(tmp_path: Path) -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    store = LocalStore(tmp_path)
    master = {"w": torch.linspace(-1, 1, 512), "b": torch.zeros(16)}
    publisher = WeightPublisher(bus=bus, store=store)
    state: dict[str, Any] = {k: torch.full_like(v, 3.0) for k, v in publisher.snapshot(master).items()}
    worker = f"rollout-{uuid.uuid4().hex[:6]}"
    sync = WeightSync(bus=bus, store=store, state=state, worker_id=worker)
    keyframes = value("rlbus_weight_publish_bytes_total", kind="keyframe")
    deltas = value("rlbus_weight_publish_bytes_total", kind="delta")

    assert await sync.handle(await publisher.publish(master, version=publisher.version + 1))
    master["w"][:10] += 0.5
    assert await sync.handle(await publisher.publish(master, version=publisher.version + 1))

    assert value("rlbus_weight_publish_bytes_total", kind="keyframe") > keyframes
    assert value("rlbus_weight_publish_bytes_total", kind="delta") > deltas
    assert value("rlbus_weight_full_bytes") == (512 + 16) * 2  # bf16
    assert value("rlbus_policy_version", worker=worker) == 2
    assert value("rlbus_weight_swap_pause_seconds_count", worker=worker) == 2
    assert value("rlbus_weight_sync_bytes_total", worker=worker) == sum(s.bytes_fetched for s in sync.history) > 0
    stats = sync.stats()
    assert stats["version"] == 2 and stats["syncs"] == 2 and len(stats["swap_pause_ms"]) == 2


def test_prometheus_config_scrapes_every_role_on_the_metrics_port() -> None:
    import yaml

    config = yaml.safe_load((ROOT / "infra" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: (sd["names"], sd["port"]) for job in config["scrape_configs"] for sd in job["dns_sd_configs"]
    }
    assert targets == {role: ([role], 9400) for role in ("trainer", "rollout", "reward", "prompts")}
