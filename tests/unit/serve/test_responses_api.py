"""The Responses API with the official ``openai`` client: input items, function tools and their outputs,
``instructions``, ``previous_response_id`` within a session, ``store``, streamed events in OpenAI's order,
and recording exactly as chat completions (the session maps the echoed items to the ids sampled). The
engine is the scripted one (turns fixed) over a real ChatML tokenizer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import ROLLOUTS, SERVED, topic_specs
from rlbus.envs.chat import ChatFormat
from rlbus.envs.scripted import ScriptedEngine
from rlbus.serve.auth import Tenants
from rlbus.serve.gateway import Gateway
from rlbus.serve.recorder import ServedRecorder
from rlbus.serve.sessions import Sessions
from tests.fixtures.hf import CHATML, offline_tokenizer

KEY = "acme-token-0123456789abcdef"
CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"], "additionalProperties": False}}]


@asynccontextmanager
async def serving(turns: list[str]) -> AsyncIterator[tuple[Gateway, ScriptedEngine, openai.AsyncOpenAI, MemoryBus]]:
    chat = ChatFormat.for_hf_tokenizer(offline_tokenizer(CHATML))
    engine = ScriptedEngine(turns, tokenizer=chat.tokenizer)
    async with MemoryBus(topic_specs()) as bus:
        gateway = Gateway(engine=engine, chat=chat, tenants=Tenants({"acme": KEY}), model_name="scripted",
                          max_context=8192, sessions=Sessions(), bus=bus, default_max_tokens=200,
                          recorder=ServedRecorder(bus=bus))
        stop = asyncio.Event()
        task = asyncio.create_task(gateway.run(stop, "127.0.0.1", 0))
        await gateway.listening.wait()
        host, port = gateway.address or ("", 0)
        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)
        try:
            yield gateway, engine, client, bus
        finally:
            await client.close()
            stop.set()
            await task


async def on(bus: MemoryBus, topic: Any) -> list[Any]:
    async with bus.consumer([topic], group=None) as consumer:
        return [r.value for r in await consumer.getmany(timeout_s=0.05, max_records=1000)]


async def test_a_tool_round_trip_with_items_echoed_back_maps_to_the_sampled_ids() -> None:
    async with serving([CALL, "It rains in Oslo."]) as (gateway, engine, client, bus):
        session = {"X-RL-Session": "agent-r1"}
        raw = await client.responses.with_raw_response.create(
            model="scripted", instructions="Be brief.", input="Weather in Oslo?", tools=TOOLS, extra_headers=session)
        first = raw.parse()
        assert first.id.startswith("resp_") and first.status == "completed" and raw.headers["X-RL-History"] == "ok"
        message, call = first.output
        assert message.type == "message" and message.content[0].text == "Checking."  # type: ignore[union-attr]
        assert call.type == "function_call" and call.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
        assert first.usage is not None and first.usage.output_tokens == len(engine_ids(gateway, CALL))

        items: list[Any] = [{"role": "user", "content": "Weather in Oslo?"},
                            *[item.model_dump() for item in first.output],  # echoed with ids, status, annotations
                            {"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
                             "output": "rain, 4 C"}]
        raw = await client.responses.with_raw_response.create(
            model="scripted", instructions="Be brief.", input=items, tools=TOOLS, extra_headers=session)
        assert raw.headers["X-RL-History"] == "ok"  # the echoed items are the turn sampled, ids and all
        assert raw.parse().output_text == "It rains in Oslo."
        one, two = engine.requests
        assert list(two.prompt_ids[: len(one.prompt_ids)]) == list(one.prompt_ids)
        sampled = [*one.prompt_ids, *engine_ids(gateway, CALL)]
        assert list(two.prompt_ids[: len(sampled)]) == sampled

        assert gateway.recorder is not None and await gateway.recorder.flush()
        served = await on(bus, SERVED)
        assert [s.served_id for s in served] == [first.id, raw.parse().id] and {s.session_id for s in served} == {
            "agent-r1"}
        async with aiohttp.ClientSession() as http, http.post(
                f"{str(client.base_url).removesuffix('/v1/')}/rl/sessions/agent-r1/reward", json={"reward": 1},
                headers={"Authorization": f"Bearer {KEY}"}) as response:
            receipt = await response.json()
        assert response.status == 202 and (receipt["turns"], receipt["segments"]) == (2, 1)
        [rollout] = await on(bus, ROLLOUTS)
        mask = rollout.loss_mask.to_numpy().astype(bool)
        assert rollout.token_ids.to_numpy()[mask].tolist() == [*engine_ids(gateway, CALL),
                                                               *engine_ids(gateway, "It rains in Oslo.")]


async def test_previous_response_id_continues_a_stored_response_in_its_session() -> None:
    async with serving([CALL, "Rain.", "x"]) as (_, engine, client, _):
        session = {"X-RL-Session": "agent-r2"}
        first = await client.responses.create(model="scripted", input="Oslo?", tools=TOOLS, extra_headers=session)
        call = first.output[-1]
        raw = await client.responses.with_raw_response.create(
            model="scripted", previous_response_id=first.id, tools=TOOLS, extra_headers=session,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])  # type: ignore[union-attr]
        assert raw.headers["X-RL-History"] == "ok" and raw.parse().output_text == "Rain."
        assert (await client.responses.retrieve(first.id)).id == first.id
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as gone:
            await client.responses.create(model="scripted", previous_response_id=first.id, input="again")
        assert gone.value.code == "previous_response_not_found"
        unstored = await client.responses.create(model="scripted", input="hi", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        assert engine.remaining == 0


async def test_streamed_events_come_in_openais_order() -> None:
    async with serving([CALL]) as (_, _, client, _):
        stream = await client.responses.create(model="scripted", input="Oslo?", tools=TOOLS, stream=True)
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    order = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
             "response.output_text.done", "response.content_part.done"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order)
    assert kinds[-6:-1] == ["response.output_item.done", "response.output_item.added",
                            "response.function_call_arguments.delta", "response.function_call_arguments.done",
                            "response.output_item.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output[0].content[0].text == "Checking."
    assert final.output[1].name == "get_weather" and final.output[1].id == events[-2].item.id  # type: ignore[union-attr]


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
    ({"background": True}, "background", "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_value"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input[0].id", "invalid_value"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "invalid_value"),
    ({"frequency_penalty": 1}, "frequency_penalty", "unknown_parameter"),
])
async def test_what_cannot_be_honoured_is_refused(fields: dict[str, Any], param: str, code: str) -> None:
    async with serving([]) as (_, _, client, _):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="scripted", input="hi", extra_body=fields)
    assert (caught.value.param, caught.value.code) == (param, code), caught.value.message


async def test_the_no_op_fields_are_accepted() -> None:
    async with serving(["ok"]) as (_, _, client, _):
        reply = await client.responses.create(
            model="scripted", input=[{"type": "message", "role": "developer", "content": "terse"},
                                     {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                     {"type": "reasoning", "id": "rs_1", "summary": []}],
            reasoning={"effort": "low"}, truncation="auto", service_tier="auto", prompt_cache_key="k",
            safety_identifier="u", include=["message.output_text.logprobs"], top_logprobs=2, metadata={"task": "t"},
            parallel_tool_calls=False, max_tool_calls=3, store=True, text={"format": {"type": "text"}},
            user="u-1")
    assert reply.output_text == "ok" and reply.output[0].content[0].logprobs is not None  # type: ignore[union-attr]


def engine_ids(gateway: Gateway, text: str) -> list[int]:
    return [*gateway.chat.encode(text), gateway.chat.stop_ids[0]]
