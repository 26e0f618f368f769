"""Served traffic reaches training: an external agent's two-turn session through the gateway, closed with
a reward, and a single completion recorded as a rollout and rated later through the feedback API, are
both trained by the trainer's online lane (that their ids are the ones sampled is test_sessions.py's)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
from aiohttp.test_utils import TestClient, TestServer

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.consumers.trainer import TrainerWorker
from rlbus.models.config import PolicyConfig
from rlbus.models.policy_source import PolicySource
from rlbus.producers.feedback import FeedbackServer
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import serve_stack
from rlbus.state import MemoryStateStore
from rlbus.training.config import GRPOConfig, OnlineConfig, OptimConfig
from rlbus.training.join import JoinBuffer, Outcome, RewardPolicy, ServedJoin
from rlbus.training.online_lane import OnlineLane
from rlbus.training.trainer import Trainer

KEY = "acme-token-0123456789abcdef"
FEEDBACK_TOKEN = "feedback-token-0123456789"


async def test_a_session_and_a_rated_completion_are_trained() -> None:
    source = PolicySource(PolicyConfig.tiny())
    state = MemoryStateStore()
    async with MemoryBus(topic_specs()) as bus:
        stack = serve_stack(bus=bus, source=source, tenants=Tenants({"acme": KEY}), model_name="tiny",
                            default_max_tokens=6)
        config = OnlineConfig(enabled=True, release_every_rewards=2, release_every_s=600.0, min_count=0)
        join = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier",), timeout_s=600))
        lane = OnlineLane(join=ServedJoin(ledger=join, state=state, sources=config.sources,
                                          max_age_s=config.max_age_s, clock=time.time),
                          state=state, config=config)
        trainer = Trainer(model=source.build(seed=0), optim=OptimConfig(lr=1e-3), grpo=GRPOConfig(max_staleness=4))
        worker = TrainerWorker(bus=bus, trainer=trainer, join=join, state=state, groups_per_step=1,
                               expire_every_s=0.05, online=lane)
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(worker.run(stop))
            tasks.create_task(stack.gateway.run(stop, "127.0.0.1", 0))
            await until(stack.gateway.listening.is_set, "the gateway to listen")
            host, port = stack.gateway.address or ("", 0)
            url = f"http://{host}:{port}"
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            session = {"X-RL-Session": "agent-7"}
            messages: list[Any] = [{"role": "user", "content": "3+4="}]
            first = await client.chat.completions.create(model="tiny", messages=messages, extra_headers=session,
                                                         metadata={"task": "sums"})
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and 5+5="}]
            await client.chat.completions.create(model="tiny", messages=messages, extra_headers=session)
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/rl/sessions/agent-7/reward", json={"reward": 1.0},
                                     headers={"Authorization": f"Bearer {KEY}"}) as response:
                    assert response.status == 202

            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "2+2="}], metadata={"task": "sums"},
                extra_headers={"X-RL-Record-Rollout": "1"})
            completion = raw.parse()
            assert stack.gateway.rollouts is not None and await stack.gateway.rollouts.flush()
            feedback = FeedbackServer(bus=bus, token=FEEDBACK_TOKEN)  # the user's thumb, later
            async with TestClient(TestServer(feedback.app())) as fb:
                rated = await fb.post("/v1/feedback", json={
                    "rollout_id": completion.id, "signal": "down", "user": "ann",
                    "prompt_id": raw.headers["X-RL-Prompt-Id"]}, headers={"Authorization": f"Bearer {FEEDBACK_TOKEN}"})
                assert rated.status == 202, await rated.text()

            await until(lambda: lane.totals["samples"] == 2, "both served rollouts trained", timeout_s=120)
            stop.set()
        assert await join.outcome_of("agent-7") == [Outcome.TRAINED]
        assert await join.outcome_of(completion.id) == [Outcome.TRAINED]
        assert worker.steps[-1]["online_samples"] == 2 and trainer.version == 1
