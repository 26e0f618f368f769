"""The `rlbus status` snapshot on the in-memory bus and state, its rendering, and its CLI errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rlbus.bus import MemoryBus
from rlbus.bus.topics import PROMPTS, ROLLOUTS, topic_specs
from rlbus.cli.app import app
from rlbus.observe import status as status_module
from rlbus.observe.heartbeat import Heartbeat
from rlbus.observe.status import Snapshot, render, show, take_snapshot
from rlbus.schemas import Prompt
from rlbus.state.memory import MemoryStateStore
from rlbus.state.progress import GROUPS_DONE_COUNTER, VERSION_COUNTER


async def running_system() -> tuple[MemoryBus, MemoryStateStore]:
    bus = MemoryBus(topic_specs())
    await bus.start()
    state = MemoryStateStore()
    for i in range(5):
        await bus.send(PROMPTS, Prompt(prompt_id=f"p{i}", env="arith", text="1 + 1 = ?", group_size=2))
    async with bus.consumer([PROMPTS], group="rollout") as consumer:
        got = await consumer.getmany(timeout_s=0.1, max_records=2)
        for record in got:
            consumer.mark(record)
    await bus.send_raw(ROLLOUTS.name + ".dlq", b"bad", key=b"k")
    await state.incr(VERSION_COUNTER, 3)
    await state.incr(GROUPS_DONE_COUNTER, 8)
    beats = [
        Heartbeat(state=state, role="rollout", worker_id="rollout-eu-0", region="eu-west",
                  info=lambda: {"group": "rollout", "topics": [PROMPTS.name], "version": 3, "processed": 4,
                                "swap_pause_ms": [0.05, 0.25], "lag": 3}),
        Heartbeat(state=state, role="rollout", worker_id="rollout-us-0", region="us-east",
                  info=lambda: {"group": "rollout", "topics": [PROMPTS.name], "version": 2}),
        Heartbeat(state=state, role="reward", worker_id="judge-0",
                  info=lambda: {"group": "reward-judge", "topics": [ROLLOUTS.name], "scored": 7,
                                "hacks": {"always_equal": 2, "introspection": 1, "exit": 0}, "hack_policy": "zero"}),
        Heartbeat(state=state, role="trainer", worker_id="trainer-0",
                  info=lambda: {"group": "trainer", "step": 12, "version": 3,
                                "last_step": {"kl_k3": 1e-3, "is_ess": 0.97, "reward_mean": 0.5,
                                              "hacked": 0.25}}),
    ]
    for beat in beats:
        await beat.beat()
    return bus, state


async def test_snapshot_reads_registry_lag_counters_and_dead_letters() -> None:
    bus, state = await running_system()
    snapshot = await take_snapshot(bus=bus, state=state)
    assert snapshot.roles() == {"reward": {"-": 1}, "rollout": {"eu-west": 1, "us-east": 1}, "trainer": {"-": 1}}
    lag = {(g.group, g.topic): g for g in snapshot.lag}
    prompts = lag["rollout", PROMPTS.name]
    assert prompts.total == 3 and prompts.members == 2
    assert sum(p.committed or 0 for p in prompts.partitions) == 2
    assert ("reward-judge", ROLLOUTS.name) in lag  # discovered from a heartbeat
    assert ("reward-verifier", ROLLOUTS.name) in lag  # rlbus's own groups are always listed
    assert snapshot.trainer["version"] == 3 and snapshot.trainer["groups_done"] == 8
    assert snapshot.trainer["step"] == 12 and snapshot.trainer["last_step"]["kl_k3"] == 1e-3
    assert snapshot.dead_letters[ROLLOUTS.name] == 1 and snapshot.dead_letters[PROMPTS.name] == 0
    assert snapshot.problems == []

    data = json.loads(json.dumps(snapshot.to_json()))
    assert data["lag"][0].keys() >= {"group", "topic", "members", "partitions", "total"}
    assert {w["worker_id"] for w in data["workers"]} == {"rollout-eu-0", "rollout-us-0", "judge-0", "trainer-0"}
    assert all(w["age_s"] >= 0 for w in data["workers"])


async def test_render_shows_workers_lag_pauses_and_the_trainer() -> None:
    bus, state = await running_system()
    console = Console(record=True, width=200)
    console.print(render(await take_snapshot(bus=bus, state=state)))
    text = console.export_text()
    for expected in ("trainer v3 step 12", "8 groups done", "rollout-eu-0", "eu-west", "reward-judge",
                     "swap ms last 0.25 max 0.25", "kl 1.00e-03", "ess 0.97", "rl.rollouts.v1 1",
                     "hacks always_equal 2 introspection 1 (zero)", "reward 0.500, hacked 25%"):
        assert expected in text, expected


async def test_missing_topics_are_problems_not_crashes() -> None:
    bus = MemoryBus()
    await bus.start()
    snapshot = await take_snapshot(bus=bus, state=MemoryStateStore())
    assert snapshot.lag == [] and snapshot.dead_letters == {}
    assert any("rl.prompts.v1" in p for p in snapshot.problems)


async def test_watch_refreshes_until_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    bus, state = await running_system()
    calls = 0

    async def counting(**kwargs: Any) -> Snapshot:
        nonlocal calls
        calls += 1
        return await take_snapshot(**kwargs)

    monkeypatch.setattr(status_module, "take_snapshot", counting)
    console = Console(record=True, width=200)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(show(bus, state, console=console, watch=True, every_s=0.02), 0.3)
    assert calls >= 3
    assert "rollout-eu-0" in console.export_text()


def test_cli_reports_an_unreachable_redis_in_one_line() -> None:
    result = CliRunner().invoke(app, ["status", "--redis", "redis://127.0.0.1:1/0", "--json"])
    assert result.exit_code == 1
    assert "error:" in result.output and "127.0.0.1:1" in result.output
    assert "Traceback" not in result.output


def test_cli_reports_an_unreachable_kafka_in_one_line(redis_url: str) -> None:
    result = CliRunner().invoke(app, ["status", "--redis", redis_url, "--bootstrap", "127.0.0.1:1", "--json"])
    assert result.exit_code == 1
    assert "error: connect to Kafka at 127.0.0.1:1" in result.output
    assert "Traceback" not in result.output and "Unclosed" not in result.output
