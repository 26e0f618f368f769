"""Poison input: bytes and messages no worker can use, injected into a running loop.

Injected on every data topic while the loop runs: garbage bytes (not MessagePack), a message with a
``schema_version`` this build cannot read, an oversize rollout (2.6 MB of tokens: under Kafka's
4 MiB limit, far over the model's context), a reward whose value is NaN, and a message over the
broker's limit. Each must end in its topic's DLQ with the reason (error class and text), once per
consumer group that reads it — except the message over the limit, which the producer refuses with a
typed error and never writes — while every worker keeps running and every good rollout still trains.
Dead-lettering is at least once (a rebalance between the DLQ write and the commit repeats it), so the
check is: every injection's letter is there, and no letter has any other cause; the ledger still gives
each dead rollout exactly one outcome.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import msgspec
import numpy as np

from rlbus.bus.base import Bus
from rlbus.bus.dlq import DeadLetter, read_dead_letters
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS
from rlbus.errors import BusError
from rlbus.schemas import Prompt, Reward, Rollout, TensorData, encode
from rlbus_tools.chaos.harness import Run, run_scenario
from rlbus_tools.chaos.ledger import ScenarioReport
from rlbus_tools.chaos.pipeline import PipelineConfig
from rlbus_tools.chaos.rig import ChaosRig

GARBAGE = b"\xc1\x00 not msgpack \xff"
OVERSIZE_TOKENS = 200_000

#: (topic, error class, words the reason must contain) of every dead letter the injections cause.
EXPECTED = Counter(
    {
        (PROMPTS.name, "MalformedMessage", ""): 1,
        (PROMPTS.name, "SchemaVersionError", "schema_version 99"): 1,
        (ROLLOUTS.name, "MalformedMessage", ""): 2,  # garbage: reward worker and trainer
        (ROLLOUTS.name, "SchemaVersionError", "schema_version 99"): 2,
        (ROLLOUTS.name, "MalformedMessage", "carries no prompt"): 1,  # oversize, at the reward worker
        (ROLLOUTS.name, "MalformedMessage", "exceeds max_seq"): 1,  # oversize, at the trainer
        (REWARDS.name, "MalformedMessage", ""): 1,
        (REWARDS.name, "SchemaVersionError", "schema_version 99"): 1,
        (REWARDS.name, "MalformedMessage", "not a finite number"): 1,
    }
)


def oversize_rollout(rollout_id: str, tokens_n: int = OVERSIZE_TOKENS) -> Rollout:
    tokens = np.full(tokens_n, 65, dtype=np.int32)
    mask = np.zeros(tokens_n, dtype=np.uint8)
    mask[1:] = 1
    return Rollout(
        rollout_id=rollout_id, prompt_id=rollout_id.rsplit("/", 1)[0], group_index=0, group_size=1,
        token_ids=TensorData.from_numpy(tokens), loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask == 1, -1.0, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask == 1, 0, -1).astype(np.int32)),
    )


def _wrong_version(message: msgspec.Struct) -> bytes:
    return encode(msgspec.structs.replace(message, schema_version=99))  # type: ignore[arg-type]


async def poison(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    config = PipelineConfig.seeded(seed, prompts=16 if quick else 32)

    async def fault(run: Run) -> None:
        p, report, bus = run.pipeline, run.report, run.pipeline.bus
        await run.wait_outcomes(0.2)
        victim = p.rollouts_made[0][3]
        oversize_id = f"poison-oversize-{p.run_id}/0"
        prompt = Prompt(prompt_id=f"poison-{p.run_id}", env="arith", text="1+1=", group_size=1)
        small = oversize_rollout("poison-v99/0", tokens_n=8)
        sends = [
            (PROMPTS.name, GARBAGE, "garbage bytes"),
            (PROMPTS.name, _wrong_version(prompt), "prompt with schema_version 99"),
            (ROLLOUTS.name, GARBAGE, "garbage bytes"),
            (ROLLOUTS.name, _wrong_version(small), "rollout with schema_version 99"),
            (ROLLOUTS.name, encode(oversize_rollout(oversize_id)), f"{OVERSIZE_TOKENS}-token rollout"),
            (REWARDS.name, GARBAGE, "garbage bytes"),
            (REWARDS.name, _wrong_version(Reward(reward_id="r99", rollout_id=victim, prompt_id="x",
                                                 source="verifier", value=1.0)), "reward with schema_version 99"),
            (REWARDS.name, encode(Reward(reward_id="nan", rollout_id=victim, prompt_id=victim.rsplit("/", 1)[0],
                                         source="verifier", value=math.nan)), f"NaN reward for {victim}"),
        ]
        for topic, value, what in sends:
            await bus.send_raw(topic, value, key=b"poison")
            report.faults.append(f"{topic}: {what} ({len(value)} B)")
        injected_at = time.monotonic()
        run.injected.append(oversize_id)
        run.extra_outcomes = 3  # the trainer records its three dead rollouts (garbage, v99, oversize)
        try:
            await bus.send_raw(ROLLOUTS.name, b"\0" * (5 * 1024 * 1024), key=b"poison")
            refused = False
        except BusError as exc:
            refused = True
            report.extra["oversize_produce_error"] = str(exc)[:160]
        report.faults.append(f"{ROLLOUTS.name}: 5 MiB message (over the 4 MiB limit)")
        report.check("a message over the broker's limit is refused with a typed error", refused)

        letters = await _wait_letters(bus, sum(EXPECTED.values()), timeout_s=90)
        found = Counter[tuple[str, str, str]]()
        unexplained = []
        for letter in letters:
            matches = [k for k in EXPECTED if k[0] == letter.source_topic and k[1] == letter.error_class
                       and k[2] in letter.error]
            key = min(matches, key=lambda k: (found[k] >= EXPECTED[k], -len(k[2]))) if matches else None
            if key is None:
                unexplained.append(f"{letter.source_topic} {letter.error_class}: {letter.error[:80]}")
            else:
                found[key] += 1
        report.check("every injection dead-lettered with its reason", all(found[k] >= n for k, n in EXPECTED.items()))
        report.check("nothing else dead-lettered", not unexplained)
        if unexplained:
            report.notes.append(f"unexpected dead letters: {unexplained[:4]}")
        report.extra["dead_letters"] = len(letters)
        report.recovery_s = await run.progress.wait_recovery(injected_at, timeout_s=60)
        report.notes.append("recovery = injection → next outcome recorded; dead_lettered counts the trainer's "
                            "rollout outcomes (DLQ letters, per consumer group, in extra.dead_letters)")

    return await run_scenario(rig, "poison", config=config, fault=fault)


async def _wait_letters(bus: Bus, want: int, timeout_s: float) -> list[DeadLetter]:
    deadline = time.monotonic() + timeout_s
    while True:
        letters = [d for topic in (PROMPTS.name, ROLLOUTS.name, REWARDS.name)
                   for d in await read_dead_letters(bus, topic)]
        if len(letters) >= want or time.monotonic() > deadline:
            return letters
        await asyncio.sleep(0.5)
