"""The client matrix: real agent and eval frameworks, installed from the package index in their own
environment (.venv-clients, `make clients-env`; infra/clients-env.sh says why it is separate), each run
as a program of its own against one `rlbus serve` gateway on SmolLM2 and real Kafka: the OpenAI Agents SDK
with its defaults (the Responses API, streamed, a function tool), litellm's OpenAI-compatible provider, and
inspect-ai's OpenAI provider. Each must finish with 0 errors, and every session it played must land as one
rollout holding every turn the model sampled for it (one served record per turn, all of them in the
rollout's trained tokens) and its reward.

Without the client environment the tests skip, naming the command; with ``RLBUS_REQUIRE_CLIENTS=1`` (CI)
they fail."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus.kafka import KafkaBus, KafkaSettings
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, SERVED
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import ServeStack, serve_stack
from tests.conftest import KAFKA_BOOTSTRAP
from tests.integration.test_serve_kafka import read_all

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
PYTHON = Path(os.environ.get("RLBUS_CLIENTS_PYTHON", ROOT / ".venv-clients" / "bin" / "python"))
KEY = "acme-token-0123456789abcdef"
MODEL = "smollm2"


def client_python() -> Path:
    if PYTHON.exists():
        return PYTHON
    hint = f"no client environment at {PYTHON}: run `make clients-env`"
    if os.environ.get("RLBUS_REQUIRE_CLIENTS") == "1":
        pytest.fail(f"RLBUS_REQUIRE_CLIENTS=1 but {hint}")
    pytest.skip(hint)


@dataclass
class Served:
    url: str
    prefix: str
    stack: ServeStack
    loop: asyncio.AbstractEventLoop
    """The gateway's own event loop (its thread's)."""


@pytest.fixture(scope="module")
def gateway(smollm2_dir: Path) -> Iterator[Served]:
    """One gateway for the module, on its own event loop in a thread: the client programs talk to it over
    HTTP while the tests wait on them."""
    from rlbus.models.hf_source import HFSource

    client_python()
    prefix = f"test-clients-{uuid.uuid4().hex[:8]}."
    bus = NamespacedBus(KafkaBus(KafkaSettings(bootstrap=KAFKA_BOOTSTRAP, client_id="rlbus-tests")), prefix)
    stack = serve_stack(bus=bus, source=HFSource(smollm2_dir), tenants=Tenants({"acme": KEY}),
                        model_name=MODEL, connect_bus=True, create_topics=True, default_max_tokens=24)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(stack.gateway.run(stop, "127.0.0.1", 0))
        finally:
            loop.run_until_complete(bus.close())

    thread = threading.Thread(target=serve, name="gateway", daemon=True)
    thread.start()
    listening = asyncio.run_coroutine_threadsafe(stack.gateway.listening.wait(), loop)
    listening.result(timeout=120)
    host, port = stack.gateway.address or ("", 0)
    try:
        yield Served(url=f"http://{host}:{port}", prefix=prefix, stack=stack, loop=loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)


def run_client(gateway: Served, program: str, tag: str) -> dict[str, Any]:
    """Run a client program under the client environment's python; its one JSON line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLBUS_", "OPENAI_"))}
    env.update(RLBUS_BASE_URL=f"{gateway.url}/v1", RLBUS_API_KEY=KEY, RLBUS_MODEL=MODEL,
               RLBUS_SESSION_PREFIX=f"{tag}{uuid.uuid4().hex[:6]}", PYTHONPATH=str(CLIENTS),
               OPENAI_AGENTS_DISABLE_TRACING="1", INSPECT_LOG_LEVEL="warning", LITELLM_LOCAL_MODEL_COST_MAP="True",
               NO_PROXY="127.0.0.1,localhost")
    done = subprocess.run([str(client_python()), str(CLIENTS / program)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=CLIENTS, check=False)
    assert done.returncode == 0, f"{program} failed:\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{program} printed no report:\n{done.stdout}\n{done.stderr[-2000:]}"
    return dict(json.loads(lines[-1]))


def check_sessions(gateway: Served, report: dict[str, Any]) -> None:
    """Each session: one rollout (its id) holding every turn sampled for it, its reward, receipts that say so."""
    ids = [s["id"] for s in report["sessions"]]
    assert ids and len(set(ids)) == len(ids)

    async def read() -> tuple[list[Any], list[Any], list[Any]]:
        bus = NamespacedBus(KafkaBus(KafkaSettings(bootstrap=KAFKA_BOOTSTRAP, client_id="rlbus-tests")),
                            gateway.prefix)
        await bus.start()
        try:
            assert await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                gateway.stack.recorder.flush(), gateway.loop))
            served = [s for s in await read_all(bus, SERVED, 1_000, 5) if s.session_id in ids]
            rollouts = [r for r in await read_all(bus, ROLLOUTS, 1_000, 5) if r.rollout_id in ids]
            rewards = [r for r in await read_all(bus, REWARDS, 1_000, 5) if r.rollout_id in ids]
            return served, rollouts, rewards
        finally:
            await bus.close()

    served, rollouts, rewards = asyncio.run(read())
    assert sorted(r.rollout_id for r in rollouts) == sorted(ids)  # one rollout per session
    assert sorted(r.rollout_id for r in rewards) == sorted(ids)
    for session in report["sessions"]:
        turns = [s for s in served if s.session_id == session["id"]]
        [rollout] = [r for r in rollouts if r.rollout_id == session["id"]]
        assert turns, f"no served turn recorded for {session['id']}"
        assert int(rollout.metadata["turns"]) == len(turns) == session["receipt"]["turns"]
        assert rollout.metadata["request_ids"].split(",") == [s.served_id for s in sorted(turns, key=_order)]
        trained = rollout.token_ids.to_numpy()[rollout.loss_mask.to_numpy().astype(bool)].tolist()
        sampled = [t for s in sorted(turns, key=_order) for t in s.token_ids.to_numpy().tolist()]
        assert sorted(trained) == sorted(sampled) and len(trained) == len(sampled)  # every sampled token, once
        assert session["receipt"]["rollout"]["topic"] == f"{gateway.prefix}rl.rollouts.v1"


def _order(s: Any) -> float:
    return float(s.created_at)


def test_the_openai_agents_sdk_with_its_defaults(gateway: Served) -> None:
    report = run_client(gateway, "agents_sdk.py", "a")
    assert report["tools_called"] == 1 and report["events"] > 0 and all(report["outputs"])
    check_sessions(gateway, report)


def test_litellms_openai_compatible_provider(gateway: Served) -> None:
    report = run_client(gateway, "litellm_client.py", "l")
    check_sessions(gateway, report)


def test_inspect_ais_openai_provider(gateway: Served) -> None:
    report = run_client(gateway, "inspect_eval.py", "i")
    assert report["status"] == "success" and report["errors"] == [] and report["error"] is None, report
    check_sessions(gateway, report)

