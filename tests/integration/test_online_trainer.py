"""Online learning end to end, on the embedded bus and on real Kafka with Redis: a small policy serves
questions — through the rollout fleet's engine directly, and through `rlbus serve` with the official
``openai`` client — each answer recorded as one served Rollout, users rate some
of them through the feedback API, the trainer trains on exactly the rated ones and publishes a version the
serving engine swaps to, and the unrated ones keep waiting — across a trainer restart — until their thumbs
arrive; a multi-turn agent session closed with a reward on the gateway's session route trains exactly the
tokens the gateway sampled."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rlbus.bus import Bus, MemoryBus
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import topic_specs
from rlbus.envs.tasks import generate_prompts
from rlbus.models.config import DEMO_SHAPE
from rlbus.models.policy_source import PolicySource
from rlbus.models.sources import ModelSource
from rlbus.producers.feedback import FeedbackServer
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import ServeStack, run_serve, serve_stack
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore
from rlbus.training.config import GRPOConfig, OnlineConfig
from rlbus.training.join import Outcome
from rlbus.wiring.infra import open_store
from rlbus.wiring.rollout import rollout_stack
from rlbus.wiring.trainer import TrainerStack, trainer_stack
from rlbus_tools.bench.online import serve as serve_gateway
from rlbus_tools.bench.online import serve_direct
from tests.conftest import kafka_bus

TOKEN = "online-trainer-test-token"
ONLINE = OnlineConfig(enabled=True, release_every_rewards=4, release_every_s=3600.0, min_count=0)


@pytest.fixture(params=["memory", "kafka"])
async def wiring(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Bus, StateStore]]:
    bus: Bus
    if request.param == "memory":
        bus = MemoryBus(topic_specs())
        await bus.start()
        state: StateStore = MemoryStateStore()
    else:
        bus = NamespacedBus(await kafka_bus(), f"online-{uuid.uuid4().hex[:8]}.")
        await bus.create_topics(topic_specs(partitions=2))
        state = RedisStateStore.from_url(request.getfixturevalue("redis_url"), key_prefix=f"t{uuid.uuid4().hex}:")
    yield bus, state
    await state.close()
    await bus.close()


@asynccontextmanager
async def gateway_and_trainer(
    bus: Bus, state: StateStore, tmp_path: Path, *, seed: int
) -> AsyncIterator[tuple[TrainerStack, ServeStack, str]]:
    """A trainer (version 1 published) and `rlbus serve` over a fresh rollout stack following it, both
    running until the block ends; yields them and the gateway's root URL once it serves version 1."""
    source = PolicySource(DEMO_SHAPE)
    stack = trainer(bus, state, tmp_path / "blobs", source)
    await stack.trainer.publish()
    gateway = serve_stack(bus=bus, source=source, tenants=Tenants({"acme": TOKEN}),
                          store=open_store(str(tmp_path / "blobs")), seed=seed)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(run_serve(gateway, stop, host="127.0.0.1", port=0))
        tasks.create_task(stack.worker.run(stop))
        try:
            await gateway.gateway.listening.wait()
            assert gateway.rollout.sync is not None
            await gateway.rollout.sync.ready.wait()
            host, port = gateway.gateway.address or ("", 0)
            yield stack, gateway, f"http://{host}:{port}"
        finally:
            stop.set()


def trainer(bus: Bus, state: StateStore, store_dir: Path, source: ModelSource) -> TrainerStack:
    return trainer_stack(bus=bus, state=state, store=open_store(str(store_dir)), store_url=str(store_dir),
                         model=source.build(seed=0), lr=1e-3, grpo=GRPOConfig(max_staleness=2), groups_per_step=4,
                         expire_every_s=0.1, online=ONLINE)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def thumbs(bus: Bus, items: list[dict[str, Any]]) -> None:
    async with TestClient(TestServer(FeedbackServer(bus=bus, token=TOKEN).app())) as client:
        response = await client.post("/v1/feedback:batch", json=items, headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 202, await response.text()


async def test_served_rollouts_train_when_their_thumbs_arrive(wiring: tuple[Bus, StateStore], tmp_path: Path) -> None:
    bus, state = wiring
    source = PolicySource(DEMO_SHAPE)
    first = trainer(bus, state, tmp_path / "blobs", source)
    await first.trainer.publish()  # v1, the weights the serving engine starts from
    serving = rollout_stack(bus=bus, store=open_store(str(tmp_path / "blobs")), model=source, worker_id="serve-0",
                            seed=1)
    assert serving.sync is not None and first.worker.online is not None
    stop, serving_stop = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(serving.sync.run(serving_stop))
        await serving.sync.ready.wait()
        run = tasks.create_task(first.worker.run(stop))
        questions = generate_prompts("arith", seed=5, n=6, config={"digits": 1})
        answers = [await serve_direct(serving, bus, q, tenant="acme") for q in questions]
        assert all(a.group_size == 1 and a.metadata["origin"] == "served" for a in answers)
        assert {int(v) for a in answers for v in a.token_versions.to_numpy() if v >= 0} == {1}
        # four of six users rate (a thumb names the completion id and its task key)
        await thumbs(bus, [{"rollout_id": a.rollout_id, "prompt_id": a.prompt_id, "signal": s, "user": f"u{i}"}
                           for i, (a, s) in enumerate(zip(answers[:4], ["up", "down", "down", "up"], strict=True))])
        await until(lambda: len(first.worker.steps) == 1, "the online step")
        await until(lambda: serving.engine.policy_version == 2, "the serving engine on the new version")
        metrics = first.worker.steps[-1]
        assert metrics["online_samples"] == 4 and metrics["published"]
        assert metrics["reward_mean"] == pytest.approx(0.5)
        for a in answers[:4]:
            assert await first.join.outcome_of(a.rollout_id) == [Outcome.TRAINED]
        await until(lambda: first.worker.online is not None and not first.worker.online.ready, "the queue drained")
        assert await first.worker.online.join.waiting() == 2
        stop.set()
        await run

        # A new trainer process (same state store, same consumer group) gets the last two thumbs, later.
        second = trainer(bus, state, tmp_path / "blobs2", source)
        second.trainer.continue_after(first.trainer.version)
        stop = asyncio.Event()
        run = tasks.create_task(second.worker.run(stop))
        await thumbs(bus, [{"rollout_id": a.rollout_id, "prompt_id": a.prompt_id, "signal": "up", "user": "late"}
                           for a in answers[4:]])
        await until(lambda: second.worker.online is not None and len(second.worker.online.ready) == 2,
                    "the waiting rollouts released by their late thumbs")
        second.worker.online.last_release -= 3600  # the release interval has passed
        await until(lambda: len(second.worker.steps) == 1, "the second trainer's online step")
        assert second.worker.steps[-1]["online_samples"] == 2
        for a in answers:
            assert await second.join.outcome_of(a.rollout_id) == [Outcome.TRAINED]
        assert (await second.join.counts())["duplicate"] == 0
        stop.set()
        serving_stop.set()


async def test_gateway_completions_and_late_thumbs_train(wiring: tuple[Bus, StateStore], tmp_path: Path) -> None:
    """The same through `rlbus serve` and the official openai client: the completion id in the response is
    the rollout the thumbs name; the trainer trains it and the gateway serves the new version."""
    import openai

    bus, state = wiring
    async with gateway_and_trainer(bus, state, tmp_path, seed=2) as (stack, gateway, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        questions = generate_prompts("arith", seed=6, n=5, config={"digits": 1})
        answers = [await serve_gateway(client, gateway.gateway.model_name, q, max_tokens=16) for q in questions]
        await client.close()
        assert len({a.completion_id for a in answers}) == 5 and {a.prompt_id for a in answers} == {"arith"}
        await thumbs(bus, [{"rollout_id": a.completion_id, "prompt_id": a.prompt_id, "signal": s}
                           for a, s in zip(answers, ["up", "down", "up", "down"], strict=False)])
        await until(lambda: len(stack.worker.steps) == 1, "the online step")
        metrics = stack.worker.steps[-1]
        assert metrics["online_samples"] == 4 and metrics["staleness"] == {0: 4} and metrics["tokens"] > 0
        await until(lambda: gateway.rollout.engine.policy_version == 2, "the gateway on the new version")
        for a in answers[:4]:
            assert await stack.join.outcome_of(a.completion_id) == [Outcome.TRAINED]
        assert stack.worker.online is not None and await stack.worker.online.join.waiting() == 1


async def test_an_agent_session_closed_with_a_reward_trains_its_sampled_tokens(
    wiring: tuple[Bus, StateStore], tmp_path: Path
) -> None:
    """A two-turn agent session through the gateway (``X-RL-Session``), closed with a user reward on the
    session route: one served rollout whose loss tokens are exactly the ids the gateway sampled."""
    import aiohttp
    import openai

    async with gateway_and_trainer(*wiring, tmp_path, seed=3) as (stack, gateway, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        session = f"agent-{uuid.uuid4().hex[:8]}"
        headers = {"X-RL-Session": session}
        messages: list[Any] = [{"role": "user", "content": "3+4="}]
        sampled = 0
        for follow_up in ("and 2+2=", None):
            reply = await client.chat.completions.create(
                model=gateway.gateway.model_name, messages=messages, max_tokens=12, metadata={"task": "agent"},
                extra_headers=headers)
            sampled += reply.usage.completion_tokens if reply.usage else 0
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        await client.close()
        async with aiohttp.ClientSession() as http, http.post(
            f"{url}/rl/sessions/{session}/reward", json={"reward": 1.0},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as response:
            assert response.status == 202, await response.text()
            closed = await response.json()
        assert closed["rollout_id"] == session and closed["prompt_id"] == "agent"
        lane = stack.worker.online
        assert lane is not None
        await until(lambda: len(lane.ready) == 1, "the session released by its reward")
        lane.last_release -= 3600  # the release interval passes
        await until(lambda: len(stack.worker.steps) == 1, "the online step")
        metrics = stack.worker.steps[-1]
        assert metrics["online_samples"] == 1 and metrics["tokens"] == closed["sampled_tokens"]
        assert closed["sampled_tokens"] >= sampled > 0  # the completions' tokens (+ each turn's end token)
        assert await stack.join.outcome_of(session) == [Outcome.TRAINED]
