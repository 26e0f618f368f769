"""Tool calls through the gateway with the official client: a reply holding ``<tool_call>`` blocks comes
back as OpenAI ``tool_calls`` (plain and streamed), and a session sending the call back with its result
is mapped to the ids sampled. The engine is the scripted one (the model's turns are fixed), so the model
is certain to call the tool; the chat format is a real ChatML tokenizer's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai

from rlbus.envs.chat import ChatFormat
from rlbus.envs.scripted import ScriptedEngine
from rlbus.serve.auth import Tenants
from rlbus.serve.gateway import Gateway
from rlbus.serve.sessions import Sessions
from tests.fixtures.hf import CHATML, offline_tokenizer

KEY = "acme-token-0123456789abcdef"
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@asynccontextmanager
async def serving(turns: list[str]) -> AsyncIterator[tuple[Gateway, ScriptedEngine, openai.AsyncOpenAI]]:
    chat = ChatFormat.for_hf_tokenizer(offline_tokenizer(CHATML))
    engine = ScriptedEngine(turns, tokenizer=chat.tokenizer)
    gateway = Gateway(engine=engine, chat=chat, tenants=Tenants({"acme": KEY}), model_name="scripted",
                      max_context=8192, sessions=Sessions(), default_max_tokens=200)
    stop = asyncio.Event()
    task = asyncio.create_task(gateway.run(stop, "127.0.0.1", 0))
    await gateway.listening.wait()
    host, port = gateway.address or ("", 0)
    try:
        yield gateway, engine, openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)
    finally:
        stop.set()
        await task


async def test_tool_calls_round_trip_in_a_session() -> None:
    async with serving([CALL, "It rains in Oslo."]) as (gateway, engine, client):
        await _round_trip(gateway, engine, client)


async def _round_trip(gateway: Gateway, engine: ScriptedEngine, client: openai.AsyncOpenAI) -> None:
    session = {"X-RL-Session": "agent-1"}
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=messages, tools=TOOLS,
                                                                 extra_headers=session)
    reply = raw.parse()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "rain, 4 C"}]
    raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=messages, tools=TOOLS,
                                                                 extra_headers=session)
    assert raw.headers["X-RL-History"] == "ok"  # the call sent back is the turn sampled, ids and all
    assert raw.parse().choices[0].message.content == "It rains in Oslo."
    first, second = engine.requests
    sampled = [*first.prompt_ids, *engine_ids(gateway, CALL)]
    assert list(second.prompt_ids[: len(sampled)]) == sampled


async def test_a_streamed_tool_call() -> None:
    content, calls, finish = "", [], None
    async with serving([CALL]) as (_, _, client):
        stream = await client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "Oslo?"}], tools=TOOLS, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def engine_ids(gateway: Gateway, text: str) -> list[int]:
    """The ids the scripted engine sampled for ``text``: its encoding plus the end-of-turn token."""
    return [*gateway.chat.encode(text), gateway.chat.stop_ids[0]]


async def test_the_user_field_marks_a_session_when_configured_and_metrics_are_served() -> None:
    chat = ChatFormat.for_hf_tokenizer(offline_tokenizer(CHATML))
    engine = ScriptedEngine(["one", "two"], tokenizer=chat.tokenizer)
    gateway = Gateway(engine=engine, chat=chat, tenants=Tenants({"acme": KEY}), model_name="scripted",
                      max_context=8192, user_sessions=True)
    stop = asyncio.Event()
    task = asyncio.create_task(gateway.run(stop, "127.0.0.1", 0))
    await gateway.listening.wait()
    host, port = gateway.address or ("", 0)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "count"}]
        raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=messages,
                                                                     user="u-42")
        assert raw.headers["X-RL-Session"] == "u-42"
        messages += [{"role": "assistant", "content": "one"}, {"role": "user", "content": "more"}]
        raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=messages,
                                                                     user="u-42")
        assert raw.headers["X-RL-History"] == "ok"
        session = gateway.sessions.get("u-42")
        assert session is not None and len(session.request_ids) == 2
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/metrics") as response:
            text = await response.text()
        assert response.status == 200
        assert 'rlbus_serve_requests_total{route="/v1/chat/completions",status="200"}' in text
    finally:
        stop.set()
        await task
