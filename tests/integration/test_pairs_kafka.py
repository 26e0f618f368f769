"""Preference pairs mined from a namespaced run's topics on a real broker, by the library and by
``rlbus offline pairs``; the token JSONL round-trips through `PreferencePair.from_json`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.cli.app import app
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.training.pairs import MinedPairs, mine_pairs
from rlbus.training.preference import PreferencePair, write_pairs
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

PROMPT = (5, 6, 7)


def rollout(prompt_id: str, index: int, completion: Sequence[int], created_at: float = 0.0) -> Rollout:
    ids = np.array([*PROMPT, *completion], np.int32)
    mask = np.array([0] * len(PROMPT) + [1] * len(completion), np.uint8)
    return Rollout(
        rollout_id=f"{prompt_id}/{index}", prompt_id=prompt_id, group_index=index, group_size=3,
        token_ids=TensorData.from_numpy(ids), loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask, -0.5, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask, 1, -1).astype(np.int32)), created_at=created_at,
    )


def reward(r: Rollout, value: float, source: str = "verifier") -> Reward:
    return Reward(reward_id=f"{r.rollout_id}:{source}", rollout_id=r.rollout_id, prompt_id=r.prompt_id,
                  source=source, value=value, rollout_created_at=r.created_at)


@contextlib.asynccontextmanager
async def run_bus(namespace: str) -> AsyncIterator[NamespacedBus]:
    """The run's namespace on the test broker (`kafka_bus` hands it out started: closed here, not
    started twice by ``async with``)."""
    plain = await kafka_bus()
    try:
        yield NamespacedBus(plain, f"{namespace}.")
    finally:
        await plain.close()


async def seed(namespace: str) -> None:
    """A small run: two groups with contrast, one without, a redelivered copy and a broken record."""
    async with run_bus(namespace) as bus:
        await bus.create_topics([s for s in topic_specs(partitions=2) if s.name in (ROLLOUTS.name, REWARDS.name)])
        rollouts = [rollout(f"p{g}", i, (10 * g + i, 99)) for g in range(3) for i in range(3)]
        redone = rollout("p0", 2, (77,), created_at=5.0)  # p0/2 played again; only the copy is scored
        for r in [*rollouts, redone]:
            await bus.send(ROLLOUTS, r)
        await bus.send_raw(ROLLOUTS.name, b"\x00garbage", key=b"p9")
        for r in rollouts:
            if r.rollout_id != "p0/2":
                await bus.send(REWARDS, reward(r, 0.5 if r.prompt_id == "p2" else float(r.group_index)))
            await bus.send(REWARDS, reward(r, 0.0, source="judge"))
        await bus.send(REWARDS, reward(redone, 3.0))


def check(mined: MinedPairs | list[PreferencePair]) -> None:
    pairs = mined.pairs if isinstance(mined, MinedPairs) else mined
    by_prompt = {p.prompt_id: p for p in pairs}
    assert sorted(by_prompt) == ["p0", "p1"]
    assert by_prompt["p0"].chosen.token_ids == (*PROMPT, 77)  # the scored copy
    assert by_prompt["p0"].rejected.token_ids == (*PROMPT, 0, 99)
    assert by_prompt["p1"].chosen.token_ids == (*PROMPT, 12, 99)
    assert by_prompt["p1"].chosen.trained == (False, False, False, True, True)
    assert (by_prompt["p1"].chosen_reward, by_prompt["p1"].rejected_reward) == (2.0, 0.0)


def test_mine_pairs_from_a_namespaced_run_on_kafka(tmp_path: Path) -> None:
    namespace = f"pairs-{uuid.uuid4().hex[:8]}"
    asyncio.run(seed(namespace))

    async def mine() -> MinedPairs:
        async with run_bus(namespace) as bus:
            return await mine_pairs(bus, rollouts_topic=ROLLOUTS.name, rewards_topic=REWARDS.name,
                                    reward_source="verifier")

    mined = asyncio.run(mine())
    check(mined)
    assert (mined.rollouts, mined.rewards, mined.malformed, mined.groups, mined.no_contrast) == (11, 18, 1, 3, 1)
    out = tmp_path / "pairs.jsonl"
    write_pairs(out, mined.pairs)
    assert [PreferencePair.from_json(json.loads(line)) for line in out.read_text().splitlines()] == mined.pairs


def test_offline_pairs_command(tmp_path: Path) -> None:
    namespace = f"pairs-{uuid.uuid4().hex[:8]}"
    asyncio.run(seed(namespace))
    runner = CliRunner()
    env = {"RLBUS_KAFKA_BOOTSTRAP": KAFKA_BOOTSTRAP}

    out = tmp_path / "ns.jsonl"
    result = runner.invoke(app, ["offline", "pairs", "--namespace", namespace, "--source", "verifier",
                                 "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert "no contrast" in result.output and "wrote 2 pair(s)" in result.output
    check([PreferencePair.from_json(json.loads(line)) for line in out.read_text().splitlines()])

    # run.namespace from a config, topics named as on the cluster; p0 spans 3, p1 2: margin 2.5 keeps p0.
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nnamespace = "{namespace}"\n')
    out = tmp_path / "cfg.jsonl"
    result = runner.invoke(app, ["offline", "pairs", "--config", str(config), "--from-topic",
                                 f"{namespace}.{ROLLOUTS.name}", "--rewards", f"{namespace}.{REWARDS.name}",
                                 "--source", "verifier", "--margin", "2.5", "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_id"], r["chosen_reward"], r["rejected_reward"]) for r in rows] == [("p0", 3.0, 0.0)]

    result = runner.invoke(app, ["offline", "pairs", "--from-topic", "no.such.rollouts", "--rewards", "no.such.rewards",
                                 "--out", str(out)], env=env)
    assert result.exit_code == 1 and "does not exist" in result.output
