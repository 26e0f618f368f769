"""The gateway driven by the official ``openai`` client (sync, async, streaming) against the real engine
stack over a tiny random HF Llama: answers, OpenAI error bodies, and token-exact records on rl.served.v1."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import SERVED
from rlbus.schemas import Served
from tests.unit.serve.conftest import TOKENS, Running

KEY = TOKENS["acme"]
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]


async def served_on(bus: MemoryBus, gateway: Running) -> list[Served]:
    assert gateway.stack.recorder is not None
    assert await gateway.stack.recorder.flush()
    if not any((await bus.end_offsets(SERVED.name)).values()):
        return []
    async with bus.consumer([SERVED], group=None) as consumer:
        records = await consumer.getmany(timeout_s=0.05, max_records=10_000)
    return [r.value for r in sorted(records, key=lambda r: (r.partition, r.offset))]


def client(gateway: Running, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


async def test_sync_client_chat_is_recorded_token_exact(gateway: Running) -> None:
    sync = openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)
    reply = await asyncio.to_thread(
        sync.chat.completions.create, model="tiny", messages=HELLO, max_tokens=8, seed=3, user="u-1",
        metadata={"app": "docs"},
    )
    choice = reply.choices[0]
    assert reply.id.startswith("chatcmpl-")
    assert reply.system_fingerprint == "rlbus:policy:v0"
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8

    [record] = await served_on(gateway.bus, gateway)
    chat = gateway.stack.rollout.chat
    expected_prompt, _ = chat.render_messages(HELLO)
    assert record.served_id == reply.id and record.tenant == "acme" and record.user == "u-1"
    assert record.prompt_ids.to_numpy().tolist() == [*expected_prompt, *chat.model_header]
    tokens = record.token_ids.to_numpy().tolist()
    assert len(tokens) == reply.usage.completion_tokens
    assert chat.decode(tokens) == choice.message.content == record.text
    assert record.token_versions.to_numpy().tolist() == [0] * len(tokens)
    assert record.logprobs.numel == len(tokens) and (record.logprobs.to_numpy() <= 0).all()
    assert record.params.max_tokens == 8 and record.params.seed == 3 and record.metadata == {"app": "docs"}
    assert record.finish_reason == choice.finish_reason


async def test_models_and_auth(gateway: Running) -> None:
    models = await client(gateway).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError) as caught:
        await client(gateway, key="wrong-token-0123456789").chat.completions.create(model="tiny", messages=HELLO)
    assert caught.value.code == "invalid_api_key"
    assert await served_on(gateway.bus, gateway) == []


async def test_bad_requests_get_openai_error_bodies(gateway: Running) -> None:
    c = client(gateway)
    with pytest.raises(openai.NotFoundError) as missing:
        await c.chat.completions.create(model="gpt-17", messages=HELLO)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as many:
        await c.chat.completions.create(model="tiny", messages=HELLO, n=50)
    assert many.value.param == "n"
    with pytest.raises(openai.BadRequestError) as wrong_type:
        await c.chat.completions.create(model="tiny", messages=HELLO, extra_body={"temperature": "hot"})
    assert wrong_type.value.param == "temperature" and wrong_type.value.code == "invalid_type"
    with pytest.raises(openai.BadRequestError) as unknown:
        await c.chat.completions.create(model="tiny", messages=HELLO, extra_body={"best_of": 2})
    assert unknown.value.param == "best_of" and unknown.value.code == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as bias:
        await c.chat.completions.create(model="tiny", messages=HELLO, logit_bias={"42": 5})
    assert bias.value.param == "logit_bias" and bias.value.code == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as schema:
        await c.chat.completions.create(model="tiny", messages=HELLO, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert schema.value.param == "response_format" and "objectx" in schema.value.message
    with pytest.raises(openai.APIStatusError) as big:
        await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 2_000_000}])
    assert big.value.status_code == 413 and big.value.code == "request_too_large"
    with pytest.raises(openai.BadRequestError) as long:
        await c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=100_000)
    assert long.value.code == "context_length_exceeded"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.base_url}/chat/completions", data=b"{not json",
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            body = await response.json()
    assert response.status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == "invalid_json"
    assert await served_on(gateway.bus, gateway) == []


async def test_streaming_matches_the_same_seed_unstreamed(gateway: Running) -> None:
    c = client(gateway)
    whole = await c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, seed=11, temperature=1.0)
    stream = await c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, seed=11,
                                             temperature=1.0, stream=True, stream_options={"include_usage": True})
    pieces, finishes, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "stream": True}
        async with http.post(f"{gateway.base_url}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            raw = await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            assert response.headers["X-RL-Policy-Version"] == "0"
    events = [line for line in raw.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    records = await served_on(gateway.bus, gateway)
    assert sorted(r.params.stream for r in records) == [False, True, True]


async def test_n_logprobs_and_top_logprobs(gateway: Running) -> None:
    reply = await client(gateway).chat.completions.create(
        model="tiny", messages=HELLO, n=3, max_tokens=6, logprobs=True, top_logprobs=4, seed=5, temperature=0.8)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    records = await served_on(gateway.bus, gateway)
    assert sorted(r.choice_index for r in records) == [0, 1, 2] and {r.served_id for r in records} == {reply.id}
    for choice, record in zip(reply.choices, sorted(records, key=lambda r: r.choice_index), strict=True):
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        sampled = record.logprobs.to_numpy().tolist()[: len(entries)]
        assert [e.logprob for e in entries] == pytest.approx(sampled)
        for e in entries:
            assert len(e.top_logprobs) == 4
            assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # the most likely comes first
            tops = [t.logprob for t in e.top_logprobs]
            assert tops == sorted(tops, reverse=True)


def test_tool_call_blocks_become_openai_tool_calls() -> None:
    from rlbus.serve.api import split_tool_calls, turn_key

    text = 'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = split_tool_calls(text, enabled=True)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"})]
    assert split_tool_calls(text, enabled=False) == (text, [])
    assert split_tool_calls("<tool_call>{broken</tool_call>", enabled=True)[1] == []
    # a client sending the call back with other ids and spacing is the same turn
    echoed = [{"id": "other", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]
    assert turn_key(content, calls) == turn_key("Checking.", echoed)


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "look it up",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}}}}


async def test_a_client_leaving_mid_stream_is_still_recorded(gateway: Running) -> None:
    from rlbus.aio import until

    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "stream": True}
        async with http.post(f"{gateway.base_url}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            first = await response.content.readline()
            served_id = response.headers["X-RL-Served-Id"]
    assert first.startswith(b"data: {")
    await until(lambda: gateway.stack.gateway.served == 1, "the abandoned stream to finish")
    [record] = await served_on(gateway.bus, gateway)
    assert record.served_id == served_id and record.params.stream and record.token_ids.numel >= 1


CITY = {"type": "function", "function": {"name": "weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}


async def test_required_and_named_tool_choice_are_constrained_calls(tagged_gateway: Running) -> None:
    gateway = tagged_gateway
    c = client(gateway)
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        reply = await c.chat.completions.create(model="tiny-byte", messages=[{"role": "user", "content": "hi"}],
                                                tools=[CITY], tool_choice=choice, parallel_tool_calls=False,
                                                max_tokens=100, seed=4)
        [call] = reply.choices[0].message.tool_calls or []  # a random model calls, and exactly once
        assert reply.choices[0].finish_reason == "tool_calls"
        if choice != "required":
            assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    records = await served_on(gateway.bus, gateway)
    assert all(r.allowed is not None for r in records)
    positions, bits = records[-1].allowed.unpack()  # type: ignore[union-attr]
    assert bits.shape == (len(positions), (gateway.stack.gateway.grammars.n_vocab + 31) // 32)  # type: ignore[union-attr]
    assert positions.tolist() == list(range(records[-1].token_ids.numel))  # every sampled token, masked


async def test_json_response_formats_are_constrained(tagged_gateway: Running) -> None:
    c = client(tagged_gateway)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = await c.chat.completions.create(
        model="tiny-byte", messages=HELLO, max_tokens=60, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert isinstance(json.loads(reply.choices[0].message.content or "")["ok"], bool)
    stream = await c.chat.completions.create(
        model="tiny-byte", messages=HELLO, max_tokens=60, seed=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text == reply.choices[0].message.content  # the same seed: the same constrained sample


async def test_a_tagged_model_lists_tools_in_its_system_message(tagged_gateway: Running) -> None:
    """The in-house byte model has no tool template: tools go in a Hermes block, no 400 (and no session
    opened by a refused request); ``tool_choice: required`` makes it call."""
    c = client(tagged_gateway)
    raw = await c.chat.completions.with_raw_response.create(
        model="tiny-byte", messages=HELLO, tools=[CITY], tool_choice="required", max_tokens=80,
        extra_headers={"X-RL-Session": "s-tagged"})
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "tool_calls"
    prompt = tagged_gateway.stack.rollout.chat.decode(
        (await served_on(tagged_gateway.bus, tagged_gateway))[0].prompt_ids.to_numpy().tolist())
    assert "<tools>" in prompt and '"name": "weather"' in prompt
