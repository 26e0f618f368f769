"""The feedback API on the in-memory bus: auth, validation naming the field, the signal → reward mapping,
batches, 503 when the bus fails, the trainer's join completing a group on a ``user`` reward, and the CLI."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, topic_specs
from rlbus.cli.app import app as cli
from rlbus.errors import BusUnavailable, ConfigError
from rlbus.producers.feedback import FeedbackServer, load_token, prompt_of
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore
from rlbus.training.join import JoinBuffer, RewardPolicy

TOKEN = "t0ken-for-the-feedback-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOW = 1_767_225_600.0


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    instance = MemoryBus(topic_specs(partitions=2))
    await instance.start()
    yield instance
    await instance.close()


@pytest.fixture
async def client(bus: MemoryBus) -> AsyncIterator[TestClient[Any, Any]]:
    server = FeedbackServer(bus=bus, token=TOKEN, clock=lambda: NOW)
    async with TestClient(TestServer(server.app())) as test_client:
        yield test_client


async def rewards_on(bus: MemoryBus) -> list[Reward]:
    if not any((await bus.end_offsets(REWARDS.name)).values()):
        return []
    async with bus.consumer([REWARDS]) as consumer:
        records = await consumer.getmany(timeout_s=0.05)
    return [r.value for r in sorted(records, key=lambda r: (r.partition, r.offset))]


async def post(client: TestClient[Any, Any], body: Any, path: str = "/v1/feedback", **headers: str) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post(path, data=data, headers={**AUTH, **headers})
    return response.status, await response.json()


async def test_auth_is_required_except_for_health(client: TestClient[Any, Any], bus: MemoryBus) -> None:
    body = json.dumps({"rollout_id": "p/0", "signal": "up"})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response = await client.post("/v1/feedback", data=body, headers=headers)
        assert response.status == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
    health = await client.get("/healthz")  # open, revealing nothing; the count only with the token
    assert health.status == 200 and (await health.json()) == {"ok": True}
    health = await client.get("/healthz", headers=AUTH)
    assert health.status == 200 and (await health.json()) == {"ok": True, "published": 0}
    assert await rewards_on(bus) == []


async def test_signal_becomes_a_user_reward_and_the_reply_says_where(
    client: TestClient[Any, Any], bus: MemoryBus
) -> None:
    status, body = await post(client, {"rollout_id": "p-7/3", "signal": "up", "user": "alice", "comment": "nice"})
    assert status == 202
    (reward,) = await rewards_on(bus)
    assert reward == Reward(
        reward_id="p-7/3:user:alice", rollout_id="p-7/3", prompt_id="p-7", source="user", value=1.0,
        components={"up": 1.0}, reason="nice", created_at=NOW, metadata={"signal": "up", "user": "alice"},
    )
    end = await bus.end_offsets(REWARDS.name)
    assert body["topic"] == REWARDS.name and end[body["partition"]] == body["offset"] + 1
    assert body["reward_id"] == "p-7/3:user:alice" and body["value"] == 1.0


@pytest.mark.parametrize(
    ("signal", "score", "value"), [("up", None, 1.0), ("down", None, 0.0), ("up", 0.8, 0.8), ("down", 0.2, 0.2),
                                   ("up", 0.5, 0.5), ("down", 0, 0.0)],
)
async def test_value_mapping(
    client: TestClient[Any, Any], bus: MemoryBus, signal: str, score: float | None, value: float
) -> None:
    status, _ = await post(client, {"rollout_id": "p/0", "signal": signal, "score": score, "prompt_id": "q"})
    assert status == 202
    (reward,) = await rewards_on(bus)
    assert reward.value == value and reward.prompt_id == "q" and reward.components["up"] == (signal == "up")
    assert reward.components.get("score") == score
    assert reward.reward_id.startswith("p/0:user:anon-")


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        (b'{"rollout_id": "p/0", "signal": "up"', None, "not valid JSON"),
        ({"rollout_id": "p/0", "signal": "up", "stars": 5}, "stars", "unknown field"),
        ({"rollout_id": "p/0", "signal": "up", "score": 1.5}, "score", "<= 1.0"),
        ({"rollout_id": "p/0", "signal": "down", "score": -0.5}, "score", ">= 0.0"),
        ({"rollout_id": "p/0", "signal": "down", "score": 0.9}, "score", "contradicts signal 'down'"),
        ({"rollout_id": "p/0", "signal": "meh"}, "signal", "Invalid enum value"),
        ({"rollout_id": "p/0"}, "signal", "missing required field"),
        ({"rollout_id": 12, "signal": "up"}, "rollout_id", "Expected `str`"),
        ({"rollout_id": "free-form", "signal": "up"}, "prompt_id", "required because rollout_id"),
        ([{"rollout_id": "p/0", "signal": "up"}], None, "must be a JSON object"),
    ],
)
async def test_bad_requests_name_the_field_and_publish_nothing(
    client: TestClient[Any, Any], bus: MemoryBus, body: Any, field: str | None, text: str
) -> None:
    status, reply = await post(client, body)
    assert status == 400 and reply["field"] == field and text in reply["error"]
    if field:
        assert reply["error"].startswith(f"{field}: ")
    assert await rewards_on(bus) == []


async def test_batch_publishes_in_order_or_not_at_all(client: TestClient[Any, Any], bus: MemoryBus) -> None:
    items = [{"rollout_id": "p/0", "signal": "up", "user": u} for u in ("a", "b", "c")]
    status, reply = await post(client, [*items[:2], {**items[2], "score": 7}], "/v1/feedback:batch")
    assert status == 400 and reply["field"] == "[2].score"
    assert await rewards_on(bus) == []
    status, reply = await post(client, items, "/v1/feedback:batch")
    assert status == 202 and reply["accepted"] == 3
    assert [r["offset"] for r in reply["results"]] == [0, 1, 2]  # one rollout: one partition, request order
    assert [r.reward_id for r in await rewards_on(bus)] == ["p/0:user:a", "p/0:user:b", "p/0:user:c"]
    status, reply = await post(client, [], "/v1/feedback:batch")
    assert status == 400 and "1 to 500" in reply["error"]


class DownBus(MemoryBus):
    def __init__(self, hang: bool) -> None:
        super().__init__(topic_specs())
        self.hang = hang

    async def send_raw(self, topic: str, value: bytes, **kwargs: Any) -> Any:
        if self.hang:
            await asyncio.sleep(60)
        raise BusUnavailable("produce to rl.rewards.v1: broker unreachable")


@pytest.mark.parametrize("hang", [False, True])
async def test_bus_unavailable_is_503(hang: bool) -> None:
    down = DownBus(hang)
    await down.start()
    server = FeedbackServer(bus=down, token=TOKEN, publish_timeout_s=0.05)
    async with TestClient(TestServer(server.app())) as test_client:
        status, reply = await post(test_client, {"rollout_id": "p/0", "signal": "down"})
        response = await test_client.post("/v1/feedback", json={"rollout_id": "p/0", "signal": "up"}, headers=AUTH)
    assert status == 503 and "bus unavailable" in reply["error"] and reply["published"] == []
    assert response.status == 503 and response.headers["Retry-After"] == "5"
    assert server.published == 0


def rollout(prompt: str, i: int) -> Rollout:
    t = TensorData.from_numpy(np.zeros(2, dtype=np.int32))
    return Rollout(
        rollout_id=f"{prompt}/{i}", prompt_id=prompt, group_index=i, group_size=2, token_ids=t,
        loss_mask=TensorData.from_numpy(np.ones(2, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.zeros(2, dtype=np.float32)), token_versions=t,
    )


async def test_the_join_completes_a_group_on_user_rewards(client: TestClient[Any, Any], bus: MemoryBus) -> None:
    join = JoinBuffer(state=MemoryStateStore(), policy=RewardPolicy(sources=("verifier", "user")))
    for i in range(2):
        assert await join.add_rollout(rollout("g", i)) is None
        verifier = Reward(reward_id=f"g/{i}:verifier", rollout_id=f"g/{i}", prompt_id="g", source="verifier",
                          value=1.0)
        assert await join.add_reward(verifier) is None
    signals = [
        {"rollout_id": "g/0", "signal": "down", "user": "ann"},
        {"rollout_id": "g/0", "signal": "up", "score": 0.75, "user": "bob"},  # two users: the later one counts
        {"rollout_id": "g/1", "signal": "down", "score": 0.25},
    ]
    status, reply = await post(client, signals, "/v1/feedback:batch")
    assert status == 202
    published = {r.reward_id: r for r in await rewards_on(bus)}
    ready = [await join.add_reward(published[r["reward_id"]]) for r in reply["results"]]  # in publish order
    assert ready[:2] == [None, None]
    group = ready[2]
    assert group is not None and group.rollout_ids == ["g/0", "g/1"]
    assert [s.reward for s in group.rollouts] == [1.0 + 0.75, 1.0 + 0.25]
    assert [s.components["user"] for s in group.rollouts] == [0.75, 0.25]
    assert group.rollouts[0].components["user.score"] == 0.75


def test_prompt_of_follows_the_rollout_worker_ids() -> None:
    assert prompt_of("arith-12/3") == "arith-12" and prompt_of("a/b/7") == "a/b"
    assert prompt_of("x") is None and prompt_of("p/") is None and prompt_of("/3") is None and prompt_of("p/x") is None


def test_token_from_env_or_file_never_empty_or_short(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(f"  {TOKEN}\n")
    assert load_token(env={"RLBUS_FEEDBACK_TOKEN": "from-env"}) == "from-env"
    assert load_token(file=secret, env={"RLBUS_FEEDBACK_TOKEN": "from-env"}) == TOKEN
    assert load_token(env={"RLBUS_FEEDBACK_TOKEN_FILE": str(secret)}) == TOKEN
    with pytest.raises(ConfigError, match=r"feedback\.token\b"):
        load_token(env={})
    with pytest.raises(ConfigError, match=r"'feedback\.token': cannot read secret file .*missing"):
        load_token(file=tmp_path / "missing", env={})  # the error names the file
    with pytest.raises(ConfigError, match="at least 16"):
        FeedbackServer(bus=MemoryBus(), token="short")


def test_cli_send_posts_to_a_running_server() -> None:
    """``rlbus feedback send`` against a server running in another thread (the CLI runs its own loop)."""
    published: list[Reward] = []
    ready, done = threading.Event(), threading.Event()
    server_box: dict[str, FeedbackServer] = {}

    async def serve() -> None:
        memory = MemoryBus(topic_specs())
        await memory.start()
        server = FeedbackServer(bus=memory, token=TOKEN)
        server_box["server"] = server
        stop = asyncio.Event()
        task = asyncio.create_task(server.run(stop, "127.0.0.1", 0))
        await server.listening.wait()
        ready.set()
        await asyncio.to_thread(done.wait)
        published.extend(await rewards_on(memory))
        stop.set()
        await task

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    try:
        assert ready.wait(10)
        address = server_box["server"].address
        assert address is not None
        url = f"http://127.0.0.1:{address[1]}"
        runner = CliRunner()
        env = {"RLBUS_FEEDBACK_TOKEN": TOKEN}
        sent = runner.invoke(cli, ["feedback", "send", "p/1", "--down", "--score", "0.1", "--user", "u1",
                                   "--url", url], env=env)
        assert sent.exit_code == 0, sent.output
        assert json.loads(sent.output)["reward_id"] == "p/1:user:u1"
        refused = runner.invoke(cli, ["feedback", "send", "p/1", "--up", "--score", "0.1", "--url", url], env=env)
        assert refused.exit_code == 1 and "contradicts" in refused.output
        neither = runner.invoke(cli, ["feedback", "send", "p/1", "--url", url], env=env)
        assert neither.exit_code != 0 and "--up or --down" in neither.output
        wrong = runner.invoke(cli, ["feedback", "send", "p/1", "--up", "--url", url],
                              env={"RLBUS_FEEDBACK_TOKEN": "not-the-token-at-all"})
        assert wrong.exit_code == 1 and "401" in wrong.output
    finally:
        done.set()
        thread.join(10)
    assert [(r.reward_id, r.value) for r in published] == [("p/1:user:u1", 0.1)]
