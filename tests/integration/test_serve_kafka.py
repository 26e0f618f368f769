"""The gateway on real Kafka: SmolLM2 served to the official ``openai`` client (chat, streaming, tools, an
agent session) with every completion read back from Kafka token-exact; and recording that survives a bus
that is unreachable (served anyway, buffered, counted) or missing its topic until it appears (flushed)."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai

from rlbus.aio import until
from rlbus.bus import Bus, Topic
from rlbus.bus.kafka import KafkaBus, KafkaSettings
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, SERVED, topic_specs
from rlbus.metrics import REGISTRY
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import ServeStack, serve_stack
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

KEY = "acme-token-0123456789abcdef"
TENANTS = {"acme": KEY}


@asynccontextmanager
async def running(stack: ServeStack) -> AsyncIterator[str]:
    stop = asyncio.Event()
    task = asyncio.create_task(stack.gateway.run(stop, "127.0.0.1", 0))
    await asyncio.wait_for(stack.gateway.listening.wait(), 120)
    host, port = stack.gateway.address or ("", 0)
    try:
        yield f"http://{host}:{port}"
    finally:
        stop.set()
        await task


async def read_all(bus: Bus, topic: Topic[Any], want: int, timeout_s: float = 30.0) -> list[Any]:
    out: list[Any] = []
    async with bus.consumer([topic], group=None) as consumer:
        deadline = time.monotonic() + timeout_s
        while len(out) < want and time.monotonic() < deadline:
            out += [r.value for r in await consumer.getmany(timeout_s=0.5)]
    return out


async def test_smollm2_chat_stream_tools_and_a_session_land_on_kafka(smollm2_dir: Path) -> None:
    from rlbus.models.hf_source import HFSource

    prefix = f"test-serve-{uuid.uuid4().hex[:8]}."
    bus = NamespacedBus(KafkaBus(KafkaSettings(bootstrap=KAFKA_BOOTSTRAP, client_id="rlbus-tests")), prefix)
    # not started: the gateway connects in the background and creates its topics, as `rlbus serve` does
    stack = serve_stack(bus=bus, source=HFSource(smollm2_dir), tenants=Tenants(TENANTS), model_name="smollm2",
                        connect_bus=True, create_topics=True, default_max_tokens=24)
    chat = stack.rollout.chat
    try:
        async with running(stack) as url:
            sync = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            question = [{"role": "user", "content": "What is the capital of France? One word."}]
            reply = await asyncio.to_thread(sync.chat.completions.create, model="smollm2", messages=question,
                                            max_tokens=12, temperature=0)
            c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            stream = await c.chat.completions.create(model="smollm2", messages=question, max_tokens=12,
                                                     temperature=0, stream=True)
            streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            assert streamed == reply.choices[0].message.content  # greedy: the same reply, token by token

            tools = [{"type": "function", "function": {
                "name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
            history: list[dict[str, Any]] = [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
            ]
            with_tools = await c.chat.completions.create(model="smollm2", messages=history, tools=tools, max_tokens=8)

            session = {"X-RL-Session": f"agent-{uuid.uuid4().hex[:6]}"}
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
            first = await c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                    extra_headers=session, metadata={"task": "colours"})
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Another one."}]
            second = await c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                     extra_headers=session)
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/rl/sessions/{session['X-RL-Session']}/reward", json={"reward": 1.0},
                                     headers={"Authorization": f"Bearer {KEY}"}) as response:
                    assert response.status == 202, await response.text()
                    receipt = await response.json()
            assert stack.recorder is not None and await stack.recorder.flush()
            assert stack.recorder.recorded == 5

        served = {s.served_id: s for s in await read_all(bus, SERVED, 5)}
        assert len(served) == 5 and {reply.id, with_tools.id, first.id, second.id} <= set(served)
        record = served[reply.id]
        prompt, _ = chat.render_messages(question)
        assert record.prompt_ids.to_numpy().tolist() == [*prompt, *chat.model_header]
        assert chat.decode(record.token_ids.to_numpy().tolist()) == reply.choices[0].message.content
        assert (record.token_versions.to_numpy() == 0).all() and record.tenant == "acme"
        tool_prompt = chat.tokenizer.decode(served[with_tools.id].prompt_ids.to_numpy().tolist())
        assert '"name": "get_weather"' in tool_prompt and "<tool_call>" in tool_prompt and "rain, 4 C" in tool_prompt

        [rollout] = await read_all(bus, ROLLOUTS, 1)
        [reward] = await read_all(bus, REWARDS, 1)
        assert receipt["rollout"]["topic"] == prefix + ROLLOUTS.name  # where it is on the cluster, namespace and all
        assert receipt["turns"] == 2 and receipt["segments"] == 1
        assert (rollout.rollout_id, rollout.prompt_id, rollout.group_size) == (session["X-RL-Session"], "colours", 1)
        mask = rollout.loss_mask.to_numpy().astype(bool)
        sampled = [*served[first.id].token_ids.to_numpy().tolist(), *served[second.id].token_ids.to_numpy().tolist()]
        assert rollout.token_ids.to_numpy()[mask].tolist() == sampled
        assert (reward.rollout_id, reward.source, reward.value) == (rollout.rollout_id, "user", 1.0)
    finally:
        await bus.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_bus_never_fails_serving(tiny_hf_dir: Path) -> None:
    from rlbus.models.hf_source import HFSource

    bus = KafkaBus(KafkaSettings(bootstrap=f"127.0.0.1:{_closed_port()}", client_id="rlbus-tests",
                                 request_timeout_ms=2000))
    stack = serve_stack(bus=bus, source=HFSource(tiny_hf_dir), tenants=Tenants(TENANTS), model_name="tiny",
                        connect_bus=True, default_max_tokens=4)
    try:
        async with running(stack) as url:
            c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            replies = [await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                                       extra_headers={"X-RL-Session": "s"} if i == 0 else None)
                       for i in range(3)]
            assert all(r.choices[0].message is not None for r in replies)
            recorder = stack.recorder
            assert recorder is not None
            await until(lambda: recorder.down, "the recorder to find the bus down")
            assert recorder.buffered == 3 and recorder.recorded == 0
            assert "connect" in (recorder.last_error or "")
            assert REGISTRY.get_sample_value("rlbus_served_buffered") == 3
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/healthz") as response:
                    health = await response.json()
                async with http.post(f"{url}/rl/sessions/s/reward", json={"reward": 1},
                                     headers={"Authorization": f"Bearer {KEY}"}) as response:
                    closing = response.status, response.headers.get("Retry-After"), await response.json()
            assert health["recorder"]["buffered"] == 3 and health["recorder"]["down"] is True
            assert closing[0] == 503 and closing[1] is not None and closing[2]["error"]["code"] == "bus_unavailable"
            assert stack.gateway.sessions.get("s") is not None  # kept open for a retry
    finally:
        await bus.close()


async def test_records_wait_for_a_missing_topic_and_flush_when_it_appears(tiny_hf_dir: Path) -> None:
    from rlbus.models.hf_source import HFSource

    prefix = f"test-serve-{uuid.uuid4().hex[:8]}."
    bus = NamespacedBus(await kafka_bus(), prefix)  # started; the served topic does not exist yet
    stack = serve_stack(bus=bus, source=HFSource(tiny_hf_dir), tenants=Tenants(TENANTS), model_name="tiny",
                        default_max_tokens=4)
    recorder = stack.recorder
    recorder.retry_s = 0.2
    try:
        async with running(stack) as url:
            c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            ids = [(await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])).id
                   for _ in range(3)]
            await until(lambda: recorder.down, "the recorder to find the topic missing")
            assert recorder.buffered == 3
            await bus.create_topics([s for s in topic_specs() if s.name == SERVED.name])
            await until(lambda: recorder.recorded == 3, "the buffered records to be flushed")
            assert (recorder.recorded, recorder.buffered, recorder.down, recorder.dropped) == (3, 0, False, 0)
        assert sorted(s.served_id for s in await read_all(bus, SERVED, 3)) == sorted(ids)
    finally:
        await bus.close()
