"""Every built-in task end to end through the reward worker: reference solutions score 1, wrong ones 0,
a rollout that cannot be scored ends in the DLQ with its reason, a served one (rated by users) is
passed over, and the source offsets are committed."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from rlbus.bus import MemoryBus
from rlbus.bus.dlq import read_dead_letters
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.envs.agent import reference_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.tasks import generate_prompts
from rlbus.schemas import Reward, Rollout

TASKS = ["arith", "strings", "kv", "python_fn"]


async def rollouts_for(env: str, n: int, *, wrong: bool) -> list[Rollout]:
    chat = ChatFormat.for_byte_tokenizer()
    out = []
    for i, prompt in enumerate(generate_prompts(env, seed=7, n=n)):
        task: Any = env_for(prompt)
        if wrong:  # the reference solution of another prompt: well-formed, but wrong here
            other = generate_prompts(env, seed=8, n=n)[i]
            if other.reference == prompt.reference:
                continue
            episode = await reference_episode(env_for(other), other, chat=chat)  # type: ignore[arg-type]
        else:
            episode = await reference_episode(task, prompt, chat=chat)
        out.append(episode_to_rollout(episode, prompt=prompt, group_index=0))
    return out


async def collect_rewards(bus: MemoryBus, want: int) -> list[Reward]:
    out: list[Reward] = []
    async with bus.consumer([REWARDS], group=None) as consumer:
        for _ in range(200):
            out += [r.value for r in await consumer.getmany(timeout_s=0.1)]
            if len(out) >= want:
                break
    return out


async def test_every_task_scores_through_the_worker() -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    good = {env: await rollouts_for(env, 3, wrong=False) for env in TASKS}
    bad = {env: await rollouts_for(env, 3, wrong=True) for env in TASKS}
    for rollouts in [*good.values(), *bad.values()]:
        for rollout in rollouts:
            await bus.send(ROLLOUTS, rollout)
    poison = msgspec.structs.replace(good["arith"][0], rollout_id="no-prompt", prompt=None)
    await bus.send(ROLLOUTS, poison)
    # what `rlbus serve` records: no prompt, rated by its users, so passed over (not dead-lettered, no reward)
    served = msgspec.structs.replace(good["arith"][1], rollout_id="chatcmpl-1", prompt=None,
                                     metadata={"origin": "served", "tenant": "t"})  # fmt: skip
    await bus.send(ROLLOUTS, served)
    total = sum(len(r) for r in [*good.values(), *bad.values()])

    worker = RewardWorker(bus=bus, concurrency=4)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    rewards = await collect_rewards(bus, total)
    for _ in range(100):
        if (await read_dead_letters(bus, ROLLOUTS.name)) and sum(
            v or 0 for v in (await bus.committed(worker.group, ROLLOUTS.name)).values()
        ) == total + 2:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task

    by_id = {r.rollout_id: r for r in rewards}
    assert len(by_id) == total and "chatcmpl-1" not in by_id and worker.skipped_served == 1
    for env in TASKS:
        assert all(by_id[r.rollout_id].value == 1.0 for r in good[env]), env
        assert bad[env] and all(by_id[r.rollout_id].value == 0.0 for r in bad[env]), env
        expected = "sandbox" if env == "python_fn" else "verifier"
        assert all(by_id[r.rollout_id].source == expected for r in good[env])
    letters = await read_dead_letters(bus, ROLLOUTS.name)
    assert [d.error_class for d in letters] == ["MalformedMessage"] and "no prompt" in letters[0].error
    assert sum(v or 0 for v in (await bus.committed(worker.group, ROLLOUTS.name)).values()) == total + 2


async def test_hack_policy_applies_to_what_the_environment_flags(monkeypatch: Any) -> None:
    """A reward whose environment's hack monitor found hacking (``hack_kinds`` in its metadata) is published
    under ``[reward] hack_policy``, counted by kind in the heartbeat; others pass unchanged."""
    import rlbus.rewards.verifier as module
    from rlbus.envs.scoring import HACK_KINDS

    class Flagging:  # the environment: its verifier says 1.0, and flags rollouts whose id ends in "-hack";
        # one ending in "-tamper" it scores 0, as the coding grader does a tampered test run
        async def score(self, episode: Any, prompt: Any) -> Reward:
            hacked, tampered = episode.episode_id.endswith("-hack"), episode.episode_id.endswith("-tamper")
            metadata = {HACK_KINDS: "always_equal,exit"} if hacked else {"tampered": "plugin"} if tampered else {}
            return Reward(reward_id=f"{episode.episode_id}:verifier", rollout_id=episode.episode_id,
                          prompt_id=prompt.prompt_id, source="verifier", value=0.0 if tampered else 1.0,
                          reason="tests passed", metadata=metadata)  # fmt: skip

    monkeypatch.setattr(module, "env_for", lambda prompt: Flagging())
    bus = MemoryBus(topic_specs())
    await bus.start()
    [good] = await rollouts_for("arith", 1, wrong=False)
    for rollout_id in ("r-1", "r-1-hack", "r-1-tamper"):
        await bus.send(ROLLOUTS, msgspec.structs.replace(good, rollout_id=rollout_id))
    worker = RewardWorker(bus=bus, hack_policy="penalty", hack_penalty=0.75)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    rewards = {r.rollout_id: r for r in await collect_rewards(bus, 3)}
    stop.set()
    await task
    assert rewards["r-1"].value == 1.0 and rewards["r-1-hack"].value == 0.25 and rewards["r-1-tamper"].value == 0.0
    assert "hack monitor found always_equal,exit (hack_policy penalty" in rewards["r-1-hack"].reason
    assert worker.stats()["hacks"] == {"always_equal": 1, "exit": 1, "tampered": 1}
