"""Agent sessions through the gateway with the official client: earlier turns mapped to the sampled ids,
edited history reported, the closed session published as one Rollout + Reward, admission 429s."""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
import openai
import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, SERVED
from tests.unit.serve.conftest import TOKENS, Running

KEY = TOKENS["acme"]


async def on(bus: MemoryBus, topic: Any) -> list[Any]:
    if not any((await bus.end_offsets(topic.name)).values()):
        return []
    async with bus.consumer([topic], group=None) as consumer:
        records = await consumer.getmany(timeout_s=0.05, max_records=10_000)
    return [r.value for r in sorted(records, key=lambda r: (r.partition, r.offset))]


def client(gateway: Running, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)


async def turn(c: openai.AsyncOpenAI, messages: list[dict[str, Any]], session: str, **kw: Any) -> tuple[Any, Any]:
    raw = await c.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=6, extra_headers={"X-RL-Session": session}, **kw)
    return raw.parse(), raw.headers


async def close(gateway: Running, session: str, body: dict[str, Any], key: str = KEY) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway.url}/rl/sessions/{session}/reward", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
            return response.status, await response.json()


async def test_a_session_maps_history_to_sampled_ids_and_closes_into_one_rollout(gateway: Running) -> None:
    c = client(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "plan a trip"}]
    first, headers = await turn(c, messages, "s-1", metadata={"task": "trip"}, seed=1)
    assert headers["X-RL-Session"] == "s-1" and headers["X-RL-History"] == "ok"
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "content": "flights: 3"}]
    second, headers = await turn(c, messages, "s-1", seed=2)
    assert headers["X-RL-History"] == "ok" and headers["X-RL-History-Edits"] == "0"

    assert await gateway.stack.recorder.flush()
    r1, r2 = await on(gateway.bus, SERVED)
    assert r1.session_id == r2.session_id == "s-1"
    chat = gateway.stack.rollout.chat
    t1 = r1.token_ids.to_numpy().tolist()
    prefix = [*r1.prompt_ids.to_numpy().tolist(), *t1, *chat.turn_closing(t1)]
    p2 = r2.prompt_ids.to_numpy().tolist()
    assert p2[: len(prefix)] == prefix  # the first turn as sampled, not re-tokenised from its text

    status, receipt = await close(gateway, "s-1", {"reward": 0.75, "reason": "good plan"})
    assert status == 202 and receipt["rollout_id"] == "s-1" and receipt["prompt_id"] == "trip"
    [rollout] = await on(gateway.bus, ROLLOUTS)
    [reward] = await on(gateway.bus, REWARDS)
    assert (rollout.rollout_id, rollout.prompt_id, rollout.group_size, rollout.group_index) == ("s-1", "trip", 1, 0)
    assert rollout.metadata["origin"] == "served" and rollout.metadata["tenant"] == "acme"
    assert rollout.metadata["request_ids"] == f"{first.id},{second.id}"
    ids, mask = rollout.token_ids.to_numpy(), rollout.loss_mask.to_numpy().astype(bool)
    t2 = r2.token_ids.to_numpy().tolist()
    assert ids[mask].tolist() == t1 + t2  # loss mask 1 exactly on the sampled ids
    assert ids.tolist() == [*p2, *t2, *chat.turn_closing(t2)]
    lps = rollout.logprobs.to_numpy()
    np.testing.assert_allclose(lps[mask], np.concatenate([r1.logprobs.to_numpy(), r2.logprobs.to_numpy()]))
    versions = rollout.token_versions.to_numpy()
    assert (versions[mask] == 0).all() and (versions[~mask] == -1).all()
    assert (reward.rollout_id, reward.prompt_id, reward.source, reward.value) == ("s-1", "trip", "user", 0.75)
    assert reward.reason == "good plan"
    status, body = await close(gateway, "s-1", {"reward": 1.0})
    assert status == 404 and body["error"]["code"] == "session_not_found"  # closed once


async def test_edited_history_is_reported_and_not_trained(gateway: Running) -> None:
    c = client(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "write a haiku"}]
    first, _ = await turn(c, messages, "s-edit")
    messages += [{"role": "assistant", "content": (first.choices[0].message.content or "") + " (edited)"},
                 {"role": "user", "content": "another"}]
    _, headers = await turn(c, messages, "s-edit")
    assert headers["X-RL-History"] == "edited" and headers["X-RL-History-Edits"] == "1"
    assert gateway.stack.gateway.history_edits == 1
    status, _ = await close(gateway, "s-edit", {"reward": 0.0, "source": "judge"})
    assert status == 202
    [rollout] = await on(gateway.bus, ROLLOUTS)
    [reward] = await on(gateway.bus, REWARDS)
    assert reward.source == "judge" and rollout.metadata["history_edits"] == "1"
    assert await gateway.stack.recorder.flush()
    records = await on(gateway.bus, SERVED)
    assert [r.history_edited for r in records] == [False, True]
    # the edited first turn is context (rendered from its text, masked); its sample trains in a segment of its own
    ids, mask = rollout.token_ids.to_numpy(), rollout.loss_mask.to_numpy().astype(bool)
    assert ids[mask].tolist() == [*records[0].token_ids.to_numpy().tolist(), *records[1].token_ids.to_numpy().tolist()]
    assert rollout.metadata["segments"] == "2" and {t.segment for t in rollout.turns} == {0, 1}


async def test_sessions_are_per_tenant_and_bad_closes_are_refused(gateway: Running) -> None:
    await turn(client(gateway), [{"role": "user", "content": "hi"}], "s-own")
    status, body = await close(gateway, "s-own", {"reward": 1}, key=TOKENS["globex"])
    assert status == 404
    status, body = await close(gateway, "s-own", {"reward": "great"})
    assert status == 400 and body["error"]["param"] == "reward"
    status, body = await close(gateway, "s-own", {"reward": 1, "extra": 2})
    assert status == 400 and body["error"]["param"] == "extra"
    with pytest.raises(openai.BadRequestError) as caught:
        await turn(client(gateway), [{"role": "user", "content": "hi"}], "s-own", n=2)
    assert caught.value.param == "n"
    assert await on(gateway.bus, ROLLOUTS) == []


@pytest.mark.parametrize(("body", "param", "code"), [
    (b'{"reward": 1.5}', "reward", "invalid_value"),
    (b'{"reward": -0.25}', "reward", "invalid_value"),
    (b'{"reward": NaN}', "reward", "invalid_value"),  # Python's json reads these; they are not numbers to train on
    (b'{"reward": Infinity}', "reward", "invalid_value"),
    (b'{"reward": 1e999}', "reward", "invalid_value"),
    (b'{"reward": 1' + b"0" * 400 + b"}", "reward", "invalid_value"),
    (b'{"reward": true}', "reward", "invalid_value"),
    (b'{"reward": 1, "components": {"steps": NaN}}', "components", "invalid_value"),
    (b"{}", "reward", "invalid_value"),
    (b"[1]", None, "invalid_value"),
    (b"\xff\xfe{", None, "invalid_json"),  # not UTF-8: was a 500
    (b"[" * 100_000, None, "invalid_json"),  # nested too deep for the parser: was a 500
])
async def test_a_bad_reward_is_an_openai_400_and_the_session_stays_open(
    gateway: Running, body: bytes, param: str | None, code: str
) -> None:
    await turn(client(gateway), [{"role": "user", "content": "hi"}], "s-bad")
    async with aiohttp.ClientSession() as http, http.post(
        f"{gateway.url}/rl/sessions/s-bad/reward", data=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    ) as response:
        status, error = response.status, (await response.json())["error"]
    assert status == 400 and (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert await on(gateway.bus, ROLLOUTS) == [] and await on(gateway.bus, REWARDS) == []
    status, receipt = await close(gateway, "s-bad", {"reward": 1})  # the range's ends are rewards
    assert status == 202 and receipt["reward"]["value"] == 1.0


async def test_admission_refuses_rl_sessions_never_production(gateway: Running) -> None:
    c = client(gateway)
    hi = [{"role": "user", "content": "hi"}]
    for i in range(4):  # the fixture allows 4 open sessions
        await turn(c, hi, f"s-{i}")
    with pytest.raises(openai.RateLimitError) as full:
        await turn(c, hi, "s-5")
    assert full.value.code == "too_many_sessions"
    assert int(full.value.response.headers["Retry-After"]) >= 1
    await turn(c, hi, "s-0")  # an open session goes on

    admission = gateway.stack.gateway.admission
    assert admission is not None
    admission.trainer_version = lambda: 5  # the trainer is 5 versions ahead of the engine's v0 (max_staleness 2)
    with pytest.raises(openai.RateLimitError) as behind:
        await turn(c, hi, "s-1")
    assert behind.value.code == "engine_behind"
    with pytest.raises(openai.RateLimitError):
        await c.chat.completions.create(model="tiny", messages=hi, max_tokens=2,
                                        extra_headers={"X-RL-Record-Rollout": "1"})
    production = await c.chat.completions.create(model="tiny", messages=hi, max_tokens=2)
    assert production.choices[0].message is not None
    assert admission.refused == {"too_many_sessions": 1, "engine_behind": 2}


async def test_a_completion_recorded_as_a_rollout_joins_feedback_by_its_id(gateway: Running) -> None:
    c = client(gateway)
    raw = await c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=4, metadata={"task": "sum"},
        extra_headers={"X-RL-Record-Rollout": "1"})
    reply = raw.parse()
    assert raw.headers["X-RL-Rollout-Id"] == reply.id and raw.headers["X-RL-Prompt-Id"] == "sum"
    grouped = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "3+3?"}],
                                              max_tokens=4, n=2, extra_headers={"X-RL-Record-Rollout": "1"})
    for recorder in (gateway.stack.recorder, gateway.stack.gateway.rollouts):
        assert recorder is not None and await recorder.flush()
    rollouts = await on(gateway.bus, ROLLOUTS)
    [one] = [r for r in rollouts if r.rollout_id == reply.id]
    group = [r for r in rollouts if r.rollout_id != reply.id]
    assert (one.rollout_id, one.prompt_id, one.group_size) == (reply.id, "sum", 1)
    assert sorted(r.rollout_id for r in group) == [f"{grouped.id}/0", f"{grouped.id}/1"]
    assert {(r.prompt_id, r.group_size) for r in group} == {(grouped.id, 2)}
    ids, mask = one.token_ids.to_numpy(), one.loss_mask.to_numpy().astype(bool)
    served = [s for s in await on(gateway.bus, SERVED) if s.served_id == reply.id]
    assert ids[mask].tolist() == served[0].token_ids.to_numpy().tolist()
