"""The dashboard end to end: a short embedded run (every real role — prompt producer, rollout workers,
reward worker, trainer, weight publisher and syncs — on the in-memory bus) feeds the collector, the
page is served, and headless Chromium renders it: every chart must be drawn with data, none may show
its "no data yet" placeholder (the serving and hacks-by-kind cards say that the run has neither). The
screenshot goes to ``$RLBUS_ARTIFACTS/dashboard.png`` (else the test's tmp dir). Chromium (Debian
``chromium``) missing is a failure, not a skip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
import uuid
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from rlbus.aio import until
from rlbus.bus.replay import Bound
from rlbus.bus.topics import REWARDS, ROLLOUTS, WEIGHTS, topic_specs
from rlbus.bus.types import TopicSpec
from rlbus.demo import Demo, DemoConfig
from rlbus.observe.collector import Collector
from rlbus.observe.dashboard import DemoFeed, parse_since, serving
from rlbus.schemas import Reward, Rollout, TensorData, WeightVersion
from rlbus.state import open_state_store
from tests.conftest import kafka_bus

CHARTS = ("reward", "versions", "staleness", "lag", "bytes", "swaps", "mismatch", "hacked", "workers")
BROWSERS = ("chromium", "chromium-browser")


def chromium() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("Chromium is not installed: `apt-get install -y chromium` (the dashboard test fails, never skips)",
                pytrace=False)


async def browse(url: str, profile: Path, *args: str, timeout_s: float = 45.0) -> str:
    """Run headless Chromium on ``url`` and return its stdout (the DOM with --dump-dom)."""
    process = await asyncio.create_subprocess_exec(
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
        f"--user-data-dir={profile}", "--virtual-time-budget=6000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


MARKS = ("path", "circle", "rect", "td")  # what a drawn chart (or the workers table) is made of


class Cards(HTMLParser):
    """Per dashboard card: the ``data-points`` it reports, the marks (SVG shapes, table cells) actually in
    the DOM, and its text (where a placeholder or an error would show)."""

    def __init__(self) -> None:
        super().__init__()
        self.card: str | None = None
        self.depth = 0
        self.points: dict[str, int] = {}
        self.marks: dict[str, int] = {}
        self.texts: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "section" and found.get("data-chart"):
            self.card, self.depth = found["data-chart"], 0
        if self.card is None:
            return
        if tag == "section":
            self.depth += 1
        if tag in MARKS:
            self.marks[self.card] = self.marks.get(self.card, 0) + 1
        if found.get("data-points") is not None:
            self.points[self.card] = self.points.get(self.card, 0) + int(found["data-points"] or 0)

    def handle_endtag(self, tag: str) -> None:
        if self.card is not None and tag == "section":
            self.depth -= 1
            if self.depth == 0:
                self.card = None

    def handle_data(self, data: str) -> None:
        if self.card is not None:
            self.texts[self.card] = self.texts.get(self.card, "") + data


@pytest.fixture
def screenshot(tmp_path: Path) -> Path:
    """Where the screenshot goes: ``$RLBUS_ARTIFACTS/dashboard.png``, else the test's tmp dir."""
    artifacts = Path(os.environ.get("RLBUS_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    path = artifacts / "dashboard.png"
    path.unlink(missing_ok=True)
    return path


async def test_chromium_renders_every_chart_of_a_short_run(tmp_path: Path, screenshot: Path) -> None:
    chromium()  # fail before the run, not after it, when there is no browser
    config = dataclasses.replace(
        DemoConfig.quick().tuned(trainer={"warm_steps": 10, "groups_per_step": 2}, task={"group_size": 4}),
        workers=2, rl_steps=3,
        time_budget_s=120, eval_size=4,
    )
    demo = Demo(config, tmp_path / "run")
    feed = DemoFeed(demo, every_s=0.2)
    stop = asyncio.Event()
    async with serving(feed.snapshot, port=0) as url:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(feed.run(stop))
            await demo.run()
            stop.set()

        async with aiohttp.ClientSession() as session, session.get(url + "api/snapshot") as response:
            snap: dict[str, Any] = await response.json()
        assert snap["phase"] == "done" and snap["error"] is None
        assert snap["rewards"]["verifier"] and snap["staleness"] and snap["steps"] and snap["swaps"]
        assert {"rollout-0", "rollout-1", "trainer"} <= set(snap["versions"])
        assert any(w.get("delta_bytes") for w in snap["weights"])
        assert any(k.endswith("← trainer") for k in snap["lag"])
        assert all(s["hacked"] == 0.0 for s in snap["steps"]) and snap["hacks"] == {}  # the demo's tasks: no hacking

        dom = await browse(url, tmp_path / "chrome-dom", "--dump-dom")
        await browse(url, tmp_path / "chrome-shot", f"--screenshot={screenshot}", "--window-size=1400,1960")

    cards = Cards()
    cards.feed(dom)
    assert sorted(cards.points) == sorted(CHARTS), (cards.points, cards.texts)
    for chart in CHARTS:
        assert cards.points[chart] > 0 and cards.marks.get(chart, 0) > 0, chart
        assert "no data yet" not in cards.texts.get(chart, "") and "error:" not in cards.texts.get(chart, ""), chart
    assert "trainer v" in dom and 'data-charts="9"' in dom and "no reward hacking reported" in cards.texts["hacks"]
    png = await asyncio.to_thread(screenshot.read_bytes)
    assert png.startswith(b"\x89PNG") and len(png) > 50_000
    print(f"dashboard screenshot: {screenshot}")


async def test_the_page_and_its_files_are_served_without_any_network(tmp_path: Path) -> None:
    async with serving(lambda: {"now": 1.0, "counts": {}}, port=0) as url, aiohttp.ClientSession() as session:
        for path, expected in (("", "dashboard.js"), ("static/dashboard.js", "api/snapshot"),
                               ("static/dashboard.css", ".card"), ("api/snapshot", '"now"')):
            async with session.get(url + path) as response:
                assert response.status == 200, path
                body = await response.text()
                assert expected in body, path
                outside = body.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name, not a fetch
                assert "http://" not in outside and "https://" not in outside, path


async def test_collector_follows_kafka_and_redis(redis_url: str) -> None:
    """The same collector against a real broker and Redis: group-less reads from a start time, lag from
    Kafka's committed offsets, the registry from Redis. Names are unique, so a shared broker is fine."""
    run = uuid.uuid4().hex[:8]
    model, source, group, topic = f"test-{run}", f"test-{run}", f"test.dashboard.{run}", f"test.dashboard.{run}"
    bus = await kafka_bus()
    state = open_state_store(redis_url, key_prefix=f"test:{run}:")
    async with bus, state:
        await bus.create_topics([*topic_specs(), TopicSpec(topic, partitions=2)])
        start = Bound(time_ms=int(time.time() * 1000) - 1000)
        for i, value in enumerate((0.0, 1.0, 1.0)):
            await bus.send(REWARDS, Reward(reward_id=f"{run}-{i}", rollout_id=f"{run}-{i}", prompt_id=run,
                                           source=source, value=value, created_at=time.time()))
        await bus.send(WEIGHTS, WeightVersion(model_id=model, version=1, kind="keyframe", keyframe_version=1,
                                              dtype="bfloat16", chunks=[], tensors=[], model_digest="d",
                                              full_bytes=4096, encoded_bytes=4000))
        await bus.send(ROLLOUTS, Rollout(
            rollout_id=run, prompt_id=run, group_index=0, group_size=1, model_id=model, worker_id=f"w-{run}",
            region="eu-west", token_ids=TensorData.from_numpy(np.zeros(2, dtype=np.int32)),
            loss_mask=TensorData.from_numpy(np.ones(2, dtype=np.uint8)),
            logprobs=TensorData.from_numpy(np.zeros(2, dtype=np.float32)),
            token_versions=TensorData.from_numpy(np.array([1, 1], dtype=np.int32)),
        ))
        for i in range(5):  # a group that has processed 3 of 5 records: lag 2
            await bus.send_raw(topic, b"x", key=str(i).encode())
        async with bus.consumer([topic], group=group) as consumer:
            seen: list[Any] = []
            while len(seen) < 5:
                seen += await consumer.getmany(timeout_s=1.0)
            for record in sorted(seen, key=lambda r: (r.partition, r.offset))[:3]:
                consumer.mark(record)
            await consumer.commit()
        await state.heartbeat("rollout", f"w-{run}", {"region": "eu-west", "version": 1, "syncs": 1,
                                                      "swap_pause_ms": [0.4]}, ttl_s=30)

        collector = Collector(bus=bus, state=state, start=start, model_id=model, groups={topic: (group,)},
                              poll_s=0.2)
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run(stop))
            await until(lambda: len(collector.rewards.get(source, ())) == 3 and collector.counts["rollouts"]
                        and collector.lag, "three rewards, the rollouts and lag collected", every_s=0.1)
            stop.set()
    snap = collector.snapshot()
    assert snap["error"] is None
    assert sorted(p[1] for p in snap["rewards"][source]) == [0.0, 1.0, 1.0]
    assert snap["weights"] == [{"version": 1, "t": snap["weights"][0]["t"], "full_bytes": 4096,
                                "keyframe_bytes": 4000}]
    assert snap["staleness"] == {"0": 1}
    assert snap["lag"][f"{topic} ← {group}"][-1][1] == 2
    assert [w["worker_id"] for w in snap["workers"]] == [f"w-{run}"]
    assert [ms for _, _, ms in snap["swaps"][f"w-{run}"]] == [0.4]


def test_since_accepts_durations_times_offsets_and_all() -> None:
    assert parse_since("all") is None
    assert parse_since("30m", now=10_000.0) == Bound(time_ms=(10_000 - 1800) * 1000)
    assert parse_since("2h", now=10_000.0) == Bound(time_ms=(10_000 - 7200) * 1000)
    assert parse_since("1500") == Bound(offset=1500)
    assert parse_since("2026-01-01T00:00:00Z") == Bound(time_ms=1_767_225_600_000)
    with pytest.raises(ValueError, match="neither an offset"):
        parse_since("yesterday")
