"""Preference pairs from the log: the grouping rule on hand-built rollouts, and the replay + join on the
in-memory bus (ties, equal rewards, a redelivered copy, malformed records, an orphan reward, claims)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus
from rlbus.bus.claimcheck import ClaimCheckBus
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.schemas.rollout import Turn
from rlbus.training.pairs import Episode, GroupCounts, mine_pairs, pairs_from_groups
from rlbus.training.preference import PreferencePair, write_pairs

PROMPT = (5, 6, 7)


def rollout(prompt_id: str, index: int, completion: Sequence[int], *, prompt: Sequence[int] = PROMPT,
            created_at: float = 0.0, size: int = 4) -> Rollout:
    ids = np.array([*prompt, *completion], np.int32)
    mask = np.array([0] * len(prompt) + [1] * len(completion), np.uint8)
    return Rollout(
        rollout_id=f"{prompt_id}/{index}", prompt_id=prompt_id, group_index=index, group_size=size,
        token_ids=TensorData.from_numpy(ids), loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask, -0.5, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask, 3, -1).astype(np.int32)),
        created_at=created_at,
    )


def reward(r: Rollout, value: float, *, source: str = "verifier", copy: float | None = None) -> Reward:
    return Reward(reward_id=f"{r.rollout_id}:{source}:{copy}", rollout_id=r.rollout_id, prompt_id=r.prompt_id,
                  source=source, value=value, rollout_created_at=copy)


def episode(prompt_id: str, index: int, completion: Sequence[int] = (1,), **kw: object) -> Episode:
    made = Episode.from_rollout(rollout(prompt_id, index, completion, **kw))  # type: ignore[arg-type]
    assert made is not None
    return made


# --- the grouping rule ----------------------------------------------------------------------------
def test_best_and_worst_ties_go_to_the_lowest_group_index() -> None:
    members = [episode("p", i, (10 + i,)) for i in range(4)]
    rewards = [1.0, 0.0, 1.0, 0.0]
    pairs = pairs_from_groups((e, {"verifier": v}) for e, v in zip(members, rewards, strict=True))
    assert len(pairs) == 1
    assert pairs[0].chosen == members[0].example and pairs[0].rejected == members[1].example
    assert (pairs[0].prompt_id, pairs[0].chosen_reward, pairs[0].rejected_reward) == ("p", 1.0, 0.0)


def test_equal_rewards_margin_and_incomplete_groups_are_counted() -> None:
    counts = GroupCounts()
    scored = [
        (episode("equal", 0), {"v": 0.5}), (episode("equal", 1), {"v": 0.5}),
        (episode("close", 0), {"v": 0.5}), (episode("close", 1), {"v": 0.3}),
        (episode("wide", 0), {"v": 0.0}), (episode("wide", 1), {"v": 0.9}),
        (episode("alone", 0), {"v": 1.0}), (episode("alone", 1), {}),
    ]
    pairs = pairs_from_groups(scored, margin=0.25, counts=counts)
    assert [(p.prompt_id, p.chosen_reward, p.rejected_reward) for p in pairs] == [("wide", 0.9, 0.0)]
    assert (counts.groups, counts.no_contrast, counts.incomplete) == (4, 2, 1)


def test_sources_sum_and_a_rollout_missing_a_source_is_not_compared() -> None:
    a, b, c = episode("p", 0), episode("p", 1), episode("p", 2)
    pairs = pairs_from_groups([(a, {"verifier": 1.0, "judge": 0.5}), (b, {"verifier": 0.0, "judge": 0.25}),
                               (c, {"verifier": -5.0})])
    assert [(p.chosen, p.rejected, p.chosen_reward, p.rejected_reward) for p in pairs] == [
        (a.example, b.example, 1.5, 0.25)]


def test_a_group_whose_contexts_differ_is_skipped() -> None:
    counts = GroupCounts()
    scored = [(episode("p", 0, prompt=(5, 6, 7)), {"v": 1.0}), (episode("p", 1, prompt=(5, 6, 8)), {"v": 0.0})]
    assert pairs_from_groups(scored, counts=counts) == []
    assert counts.context_mismatch == 1


def test_max_pairs_keeps_the_first_groups() -> None:
    counts = GroupCounts()
    scored = [(episode(f"p{g}", i), {"v": float(i)}) for g in range(3) for i in range(2)]
    pairs = pairs_from_groups(scored, max_pairs=2, counts=counts)
    assert [p.prompt_id for p in pairs] == ["p0", "p1"] and counts.over_limit == 1


def test_episode_is_token_exact_and_refuses_what_cannot_be_a_pair_side() -> None:
    e = episode("p", 0, (9, 8))
    assert e.example.token_ids == (5, 6, 7, 9, 8)
    assert e.example.trained == (False, False, False, True, True)
    assert e.context == PROMPT
    with pytest.raises(ValueError, match="trained"):
        episode("p", 1, ())


# --- the replay and join --------------------------------------------------------------------------
async def produce(bus: NamespacedBus | ClaimCheckBus | MemoryBus, rollouts: Sequence[Rollout],
                  rewards: Sequence[Reward]) -> None:
    for r in rollouts:
        await bus.send(ROLLOUTS, r)
    for w in rewards:
        await bus.send(REWARDS, w)


async def test_mine_pairs_from_a_namespaced_run(tmp_path: Path) -> None:
    inner = MemoryBus()
    bus = NamespacedBus(inner, "run7.")
    async with bus:
        await bus.create_topics(topic_specs(partitions=2))
        tie = [rollout("tie", i, (20 + i,)) for i in range(4)]
        flat = [rollout("flat", i, (30 + i,)) for i in range(2)]
        old = rollout("redo", 0, (40,), created_at=1.0)
        new = rollout("redo", 0, (41, 42), created_at=2.0)
        other = rollout("redo", 1, (43,), created_at=2.0)
        ghost = rollout("ghost", 0, (1,))
        await produce(bus, [*tie, *flat, old, new, other], [
            *(reward(r, v) for r, v in zip(tie, [0.0, 1.0, 1.0, 0.0], strict=True)),
            *(reward(r, 0.5) for r in flat),
            reward(old, 1.0, copy=1.0),  # scored the first copy only
            reward(other, 0.0, copy=2.0),
            reward(other, 0.7, source="judge"),  # filtered out below
            reward(ghost, 1.0),  # no such rollout on the log
        ])
        await bus.send_raw(ROLLOUTS.name, b"\x00not a rollout", key=b"bad")
        await bus.send_raw(REWARDS.name, b"\x00not a reward", key=b"bad")

        mined = await mine_pairs(bus, rollouts_topic=ROLLOUTS.name, rewards_topic=REWARDS.name,
                                 reward_source="verifier")

    by_prompt = {p.prompt_id: p for p in mined.pairs}
    assert sorted(by_prompt) == ["redo", "tie"]
    assert by_prompt["tie"].chosen.token_ids == (*PROMPT, 21)  # index 1 beats 2, index 0 loses to 3
    assert by_prompt["tie"].rejected.token_ids == (*PROMPT, 20)
    assert by_prompt["redo"].chosen.token_ids == (*PROMPT, 40)  # the copy the reward scored, not the newest
    assert by_prompt["redo"].chosen.trained == (False, False, False, True)
    assert (mined.rollouts, mined.rewards, mined.malformed) == (10, 11, 2)
    assert (mined.groups, mined.no_contrast, mined.incomplete, mined.unmatched_rewards) == (3, 1, 0, 1)
    assert mined.skipped == 2

    out = tmp_path / "pairs.jsonl"
    assert write_pairs(out, mined.pairs) == 2
    back = [PreferencePair.from_json(json.loads(line)) for line in out.read_text().splitlines()]
    assert back == mined.pairs


async def test_all_sources_are_summed_without_a_filter() -> None:
    async with MemoryBus() as bus:
        await bus.create_topics(topic_specs(partitions=1))
        a, b = rollout("p", 0, (1,)), rollout("p", 1, (2,))
        await produce(bus, [a, b], [reward(a, 0.0), reward(b, 0.5), reward(a, 1.0, source="judge"),
                                    reward(b, 0.0, source="judge")])
        mined = await mine_pairs(bus, rollouts_topic=ROLLOUTS.name, rewards_topic=REWARDS.name)
    assert [(p.chosen_reward, p.rejected_reward) for p in mined.pairs] == [(1.0, 0.5)]


async def test_claim_checked_rollouts_are_resolved_with_the_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "blobs")
    async with MemoryBus() as inner:
        await inner.create_topics(topic_specs(partitions=1))
        writer = ClaimCheckBus(inner, store, threshold_bytes=1000)
        a, b = rollout("p", 0, tuple(range(100, 200))), rollout("p", 1, (2,))
        await produce(writer, [a, b], [reward(a, 1.0), reward(b, 0.0)])
        assert writer.claims_written == 1
        unresolved = await mine_pairs(inner, rollouts_topic=ROLLOUTS.name, rewards_topic=REWARDS.name)
        mined = await mine_pairs(inner, rollouts_topic=ROLLOUTS.name, rewards_topic=REWARDS.name, store=store)
    assert unresolved.pairs == [] and unresolved.malformed == 1
    assert [p.chosen.token_ids[3:] for p in mined.pairs] == [tuple(range(100, 200))]


async def test_a_reward_naming_no_copy_scores_the_newest_and_segmented_rollouts_are_counted() -> None:
    async with MemoryBus() as bus:
        await bus.create_topics(topic_specs(partitions=1))
        first, second = rollout("p", 0, (1,), created_at=2.0), rollout("p", 0, (2,), created_at=3.0)
        other = rollout("p", 1, (3,))
        split = rollout("q", 0, (4,))  # a summary turn [0, 2) then a fresh context [2, 4)
        split.turns = [Turn(role="user", text="", start=0, end=2), Turn(role="user", text="", start=2, end=4,
                                                                        segment=1)]
        await produce(bus, [second, first, other, split], [reward(first, 1.0), reward(other, 0.0),
                                                           reward(split, 1.0)])
        mined = await mine_pairs(bus, rollouts_topic=ROLLOUTS.name, rewards_topic=REWARDS.name)
    assert [p.chosen.token_ids for p in mined.pairs] == [(*PROMPT, 2)]  # created 3.0, though read first
    assert (mined.segmented, mined.malformed, mined.unmatched_rewards, mined.skipped) == (1, 0, 1, 1)
