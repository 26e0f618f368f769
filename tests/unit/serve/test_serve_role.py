"""The gateway as a role of a run: weights follow the trainer's published versions while serving (the
served version in every response and record), `rlbus worker serve` answers the openai client, and
`rlbus up --serve` starts it."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import openai

from rlbus.aio import until, wait_event
from rlbus.bus.topics import SERVED
from rlbus.launch.config import config_from_dict
from rlbus.launch.roles import serve_main
from rlbus.models.config import PolicyConfig
from rlbus.models.policy_source import PolicySource
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import run_serve, serve_stack
from rlbus.weights.publish import WeightPublisher
from rlbus.wiring.infra import open_bus, open_state, open_store
from rlbus_tools.up.roles import worker_children

KEY = "acme-token-0123456789abcdef"
HI = [{"role": "user", "content": "2+2="}]


async def test_served_versions_follow_the_trainer(tmp_path: Path) -> None:
    bus = open_bus(None, partitions=2)
    await bus.start()
    store = open_store(str(tmp_path / "blobs"))
    source = PolicySource(PolicyConfig.tiny())
    stack = serve_stack(bus=bus, source=source, tenants=Tenants({"acme": KEY}), store=store, model_name="tiny",
                        max_staleness=1, default_max_tokens=4)
    sync = stack.rollout.sync
    assert sync is not None
    publisher = WeightPublisher(bus=bus, store=store)
    master = source.build(seed=1)
    stop = asyncio.Event()
    port = _free_port()
    task = asyncio.create_task(run_serve(stack, stop, host="127.0.0.1", port=port))
    try:
        await until(lambda: stack.gateway.listening.is_set(), "the gateway to listen")
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        before = await c.chat.completions.create(model="tiny", messages=HI)  # type: ignore[arg-type]
        assert before.system_fingerprint == "rlbus:policy:v0"
        await publisher.publish(master.state_dict(), version=1)
        assert await wait_event(sync.ready, 30)
        raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=HI)  # type: ignore[arg-type]
        after = raw.parse()
        assert after.system_fingerprint == "rlbus:policy:v1" and raw.headers["X-RL-Policy-Version"] == "1"
        # the trainer races ahead while this engine cannot follow: RL sessions wait, production does not
        sync.announced = 3
        try:
            await c.chat.completions.create(model="tiny", messages=HI,  # type: ignore[arg-type]
                                            extra_headers={"X-RL-Session": "late"})
        except openai.RateLimitError as exc:
            assert exc.code == "engine_behind"
        else:
            raise AssertionError("an RL session was admitted 2 versions behind with max_staleness 1")
        assert (await c.chat.completions.create(model="tiny", messages=HI)).choices  # type: ignore[arg-type]
        assert stack.recorder is not None and await stack.recorder.flush()
        async with bus.consumer([SERVED], group=None) as consumer:
            records = [r.value for r in await consumer.getmany(timeout_s=0.1)]
        versions = {r.served_id: set(r.token_versions.to_numpy().tolist()) for r in records}
        assert versions[before.id] == {0} and versions[after.id] == {1}
        for record in records:  # the MoE policy's routing, for router replay: [layers, P + N - 1, top_k]
            assert record.routed_experts is not None
            layers, positions, k = record.routed_experts.shape
            assert (layers, k) == (4, 2) and positions == record.prompt_ids.numel + record.token_ids.numel - 1
    finally:
        stop.set()
        await task
        await bus.close()


async def test_the_serve_role_of_a_run(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"acme: {KEY}\n")
    port = _free_port()
    config = config_from_dict({"serve": {"port": port, "token_file": str(tokens), "default_max_tokens": 3},
                               "run": {"run_dir": ""}}, {})
    stop = asyncio.Event()
    bus = open_bus(None, partitions=2)
    task = asyncio.create_task(serve_main(config, worker_id="serve-test", stop=stop, bus=bus, state=open_state(),
                                          store=open_store(str(tmp_path / "blobs")), model="tiny"))
    try:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

        async def answers() -> bool:
            try:
                return bool((await c.models.list()).data)
            except openai.APIConnectionError:
                return False

        await until(answers, "the serve role to answer", timeout_s=120, check=lambda: _alive(task))
        reply = await c.chat.completions.create(model="tiny", messages=HI)  # type: ignore[arg-type]
        assert reply.usage is not None and reply.usage.completion_tokens <= 3
    finally:
        stop.set()
        await task


def test_up_starts_the_gateway_when_asked(tmp_path: Path) -> None:
    names = [c.name for c in worker_children(tmp_path / "run.toml", 1, {}, serve=True)]
    assert names == ["trainer", "reward", "rollout-0", "serve", "prompts"]
    serve = worker_children(tmp_path / "run.toml", 1, {}, serve=True)[3]
    assert serve.argv[serve.argv.index("worker") + 1] == "serve"
    assert "serve" not in [c.name for c in worker_children(tmp_path / "run.toml", 1, {})]


def _alive(task: asyncio.Task[None]) -> None:
    if task.done():
        task.result()
        raise AssertionError("the serve role stopped")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
