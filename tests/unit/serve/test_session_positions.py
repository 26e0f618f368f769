"""Sessions keyed by position, each way a client may treat its history (rlbus/serve/sessions.py says what
happens): identical replies both map, a dropped failed turn is still trained (its own segment), an edited
turn's original sample is trained under its own context, and the receipt names the topic written under a
namespace and how many turns the rollout holds. The engine is the scripted one (turns fixed, log-probs 0)
over a real ChatML tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai

from rlbus.bus import MemoryBus
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import ROLLOUTS, topic_specs
from rlbus.envs.chat import ChatFormat
from rlbus.envs.scripted import ScriptedEngine
from rlbus.schemas import Rollout
from rlbus.serve.auth import Tenants
from rlbus.serve.gateway import Gateway
from rlbus.serve.sessions import Sessions
from rlbus.training.batch import context_segments, sample_from_rollout
from tests.fixtures.hf import CHATML, offline_tokenizer

KEY = "acme-token-0123456789abcdef"


@asynccontextmanager
async def serving(turns: list[str], prefix: str = "") -> AsyncIterator[tuple[Gateway, ScriptedEngine, str, Any]]:
    chat = ChatFormat.for_hf_tokenizer(offline_tokenizer(CHATML))
    engine = ScriptedEngine(turns, tokenizer=chat.tokenizer)
    async with MemoryBus(topic_specs()) as memory:
        bus = NamespacedBus(memory, prefix) if prefix else memory
        if prefix:
            await bus.create_topics(topic_specs())
        gateway = Gateway(engine=engine, chat=chat, tenants=Tenants({"acme": KEY}), model_name="scripted",
                          max_context=8192, sessions=Sessions(), bus=bus, default_max_tokens=64)
        stop = asyncio.Event()
        task = asyncio.create_task(gateway.run(stop, "127.0.0.1", 0))
        await gateway.listening.wait()
        host, port = gateway.address or ("", 0)
        try:
            yield gateway, engine, f"http://{host}:{port}", bus
        finally:
            stop.set()
            await task


async def ask(url: str, session: str, messages: list[dict[str, Any]]) -> tuple[str, str]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(model="scripted", messages=messages,
                                                                     extra_headers={"X-RL-Session": session})
    return raw.parse().choices[0].message.content or "", raw.headers["X-RL-History"]


async def close(url: str, session: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/rl/sessions/{session}/reward", json={"reward": 1.0},
            headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status == 202, await response.text()
        return dict(await response.json())


async def rollout_of(bus: Any) -> Rollout:
    async with bus.consumer([ROLLOUTS], group=None) as consumer:
        [record] = await consumer.getmany(timeout_s=0.05)
    return record.value  # type: ignore[no-any-return]


def sampled(gateway: Gateway, rollout: Rollout) -> list[str]:
    """The texts of the rollout's trained runs of ids, in order."""
    ids, mask = rollout.token_ids.to_numpy(), rollout.loss_mask.to_numpy().astype(bool)
    runs, current = [], []
    for token, trained in zip(ids.tolist(), mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    return [gateway.chat.decode(run) for run in [*runs, *([current] if current else [])]]


async def test_identical_replies_each_map_to_their_own_sample() -> None:
    async with serving(["ls", "ls", "done"]) as (gateway, _, url, bus):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
        for _ in range(3):
            reply, history = await ask(url, "s-same", messages)
            assert history == "ok"
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
        receipt = await close(url, "s-same")
        rollout = await rollout_of(bus)
    assert (receipt["turns"], receipt["segments"]) == (3, 1)
    assert sampled(gateway, rollout) == ["ls", "ls", "done"]  # the repeated reply is not lost or masked
    assert rollout.metadata["history_edits"] == "0"


async def test_a_dropped_failed_turn_is_trained_as_its_own_segment() -> None:
    async with serving(["<broken call", "ls", "done"]) as (gateway, _, url, bus):
        ask_ = [{"role": "user", "content": "list the files"}]
        failed, _ = await ask(url, "s-drop", ask_)  # the agent finds this turn unusable and drops it
        retry, history = await ask(url, "s-drop", ask_)
        assert history == "ok"
        _, history = await ask(url, "s-drop", [*ask_, {"role": "assistant", "content": retry},
                                               {"role": "user", "content": "a.txt"}])
        assert history == "ok"
        receipt = await close(url, "s-drop")
        rollout = await rollout_of(bus)
    assert failed == "<broken call" and (receipt["turns"], receipt["segments"]) == (3, 2)
    assert sampled(gateway, rollout) == ["<broken call", "ls", "done"]  # every turn sampled, once each
    sample = sample_from_rollout(rollout)  # the trainer runs each segment as its own row
    (a, b), (c, d) = context_segments(rollout.turns, rollout.token_ids.numel)
    assert (a, d) == (0, rollout.token_ids.numel) and b == c and len(sample.spans) == 2
    ids = rollout.token_ids.to_numpy()
    assert ids[a] == ids[c]  # each segment opens a fresh context (the same conversation start)


async def test_an_edited_turn_is_context_and_its_original_sample_still_trains() -> None:
    async with serving(["four", "eight"]) as (gateway, _, url, bus):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
        first, _ = await ask(url, "s-edit", messages)
        messages += [{"role": "assistant", "content": first + " (checked)"}, {"role": "user", "content": "doubled?"}]
        _, history = await ask(url, "s-edit", messages)
        assert history == "edited"
        receipt = await close(url, "s-edit")
        rollout = await rollout_of(bus)
    assert (receipt["turns"], receipt["segments"]) == (2, 2) and rollout.metadata["history_edits"] == "1"
    assert sampled(gateway, rollout) == ["four", "eight"]  # the edited text is context, the sample is trained
    text = gateway.chat.tokenizer.decode(rollout.token_ids.to_numpy().tolist())
    assert "four (checked)" in text


async def test_the_receipt_names_the_namespaced_topic_it_wrote() -> None:
    async with serving(["hello"], prefix="run7.") as (_, _, url, bus):
        await ask(url, "s-ns", [{"role": "user", "content": "hi"}])
        receipt = await close(url, "s-ns")
        rollout = await rollout_of(bus)
    assert receipt["rollout"]["topic"] == "run7.rl.rollouts.v1" and receipt["reward"]["topic"] == "run7.rl.rewards.v1"
    assert rollout.rollout_id == "s-ns" and receipt["turns"] == 1


async def test_a_refused_request_opens_no_session() -> None:
    async with serving(["x"]) as (gateway, _, url, _):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
            try:
                await client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=100_000, extra_headers={"X-RL-Session": "s-none"})
            except openai.BadRequestError as exc:
                assert exc.code == "context_length_exceeded"
        assert gateway.sessions.get("s-none") is None  # so no 409 session_empty trap when the harness closes it
