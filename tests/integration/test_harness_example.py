"""examples/harness_openai.py, as a user runs it, against a running gateway on real Kafka: the sessions it
plays with the official ``openai`` client and closes with its rewards land on the bus — one served rollout
per session (``rollout_id`` = the session id) and one ``user`` reward carrying the value it printed — and a
wrong token makes it exit non-zero with nothing published."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, SERVED, topic_specs
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import serve_stack
from tests.conftest import kafka_bus
from tests.integration.test_serve_kafka import read_all

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "harness_openai.py"
KEY = "acme-token-0123456789abcdef"
LINE = re.compile(r"^session=(\S+) right=(\d+)/(\d+) reward=([0-9.]+) status=(\d+) answers=")


async def harness(url: str, key: str, *args: str) -> tuple[int, str, str]:
    """Run the example in a process of its own (the gateway keeps serving on this loop meanwhile)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLBUS_", "OPENAI_"))}
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), "--base-url", f"{url}/v1", *args, env={**env, "RLBUS_API_KEY": key},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def test_the_example_reads_the_number_an_answer_ends_with() -> None:
    spec = importlib.util.spec_from_file_location("harness_openai", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert [example.answer_of(t) for t in ("12", "3 + 9 = 12.", "The answer is -4", "twelve", "")] == [
        12, 12, -4, None, None]


@pytest.mark.kafka
async def test_the_example_harness_closes_its_sessions_with_rewards_on_the_bus(tiny_hf_dir: Path) -> None:
    from rlbus.models.hf_source import HFSource

    bus = NamespacedBus(await kafka_bus(), f"test-harness-{uuid.uuid4().hex[:8]}.")  # fails if Kafka is down
    names = {SERVED.name, ROLLOUTS.name, REWARDS.name}
    await bus.create_topics([t for t in topic_specs() if t.name.removesuffix(".dlq") in names])
    stack = serve_stack(bus=bus, source=HFSource(tiny_hf_dir), tenants=Tenants({"acme": KEY}),
                        model_name="tiny", default_max_tokens=8)
    stop = asyncio.Event()
    serving = asyncio.create_task(stack.gateway.run(stop, "127.0.0.1", 0))
    try:
        await asyncio.wait_for(stack.gateway.listening.wait(), 60)
        host, port = stack.gateway.address or ("", 0)
        url = f"http://{host}:{port}"
        prefix = f"h{uuid.uuid4().hex[:6]}"

        code, out, err = await harness(url, KEY, "--sessions", "3", "--turns", "2", "--max-tokens", "6",
                                       "--session-prefix", prefix, "--task", "sums")
        assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
        lines = [m.groups() for m in map(LINE.match, out.splitlines()) if m]
        assert len(lines) == 3, out
        sent = {sid: float(reward) for sid, right, turns, reward, status in lines}
        assert set(sent) == {f"{prefix}-{n}" for n in range(3)}
        assert all(status == "202" for *_, status in lines)
        assert all(float(reward) == pytest.approx(int(right) / int(turns)) for _, right, turns, reward, _ in lines)

        rewards = await read_all(bus, REWARDS, 3, 30)
        assert {r.rollout_id: r.value for r in rewards} == pytest.approx(sent)
        assert {(r.source, r.prompt_id, r.reward_id) for r in rewards} == {
            ("user", "sums", f"{sid}:user:session") for sid in sent}
        rollouts = {r.rollout_id: r for r in await read_all(bus, ROLLOUTS, 3, 30)}
        assert set(rollouts) == set(sent)
        for sid, rollout in rollouts.items():  # what [trainer.online] trains: a served group of one
            assert (rollout.group_size, rollout.prompt_id, rollout.metadata["origin"]) == (1, "sums", "served")
            assert rollout.metadata["session_id"] == sid and rollout.metadata["tenant"] == "acme"
            assert len(rollout.metadata["request_ids"].split(",")) == 2  # both turns, one session
            assert rollout.loss_mask.to_numpy().sum() > 0
        assert await stack.recorder.flush()
        served = await read_all(bus, SERVED, 6, 30)
        assert sorted(s.session_id for s in served) == sorted([*sent, *sent])  # the X-RL-Session header arrived
        assert stack.gateway.sessions.closed == 3 and len(stack.gateway.sessions) == 0

        code, out, err = await harness(url, "wrong-token-0123456789abcdef", "--sessions", "2", "--model", "tiny")
        assert code != 0 and "401" in err and "invalid_api_key" in err, f"stdout:\n{out}\nstderr:\n{err}"
        assert len(await read_all(bus, REWARDS, 4, 3)) == 3  # nothing more published
    finally:
        stop.set()
        await serving
        await bus.close()
