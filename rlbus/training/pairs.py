"""Preference pairs mined from a run's durable log: each prompt group's best and worst rollout by reward.

Every run keeps its rollouts (``rl.rollouts.v1``) and rewards (``rl.rewards.v1``) on Kafka. `mine_pairs`
replays both (`rlbus.bus.replay.read_window`: end offsets snapshotted first, so it terminates while
producers write; rewards are read before rollouts, so every reward's rollout is inside the rollouts'
later snapshot), joins them and hands the groups to `pairs_from_groups`, which makes at most one
`PreferencePair` per prompt. Token-exact: ``chosen`` and ``rejected`` are the rollouts' own ``token_ids``
with ``loss_mask`` as the trained mask — what the engine sampled, the prompt, role headers and tool
results as context.

The join, rollout id by rollout id:

* **Copies.** A prompt redelivered after a crash is played again under the same rollout ids. A reward
  naming a copy (``rollout_created_at``) scores that copy only — no copy with that time: the reward is
  unmatched; one naming none scores the newest copy (largest ``created_at``, later on the log on a
  tie). The rollout is then the newest copy that has a reward.
* **Sources.** With ``reward_source`` only that source's rewards count. Otherwise a rollout's reward is
  the *sum* over its sources (as the trainer's default, `rlbus.training.batch.groups_from_rollouts`),
  and only rollouts scored by every source seen in their group are compared, so a sum of two scores
  never meets a sum of one. A source scoring one copy twice: the later reward counts.
* **Pairs.** A group with ≥ 2 scored rollouts gives (best, worst): the highest and the lowest reward,
  ties to the lowest ``group_index``, kept when best − worst > ``margin``. Its two rollouts must share
  the context before their first trained token, else the group is skipped and counted.

Nothing in the log crashes the miner: a record that does not decode, a rollout whose arrays are
inconsistent (`rlbus.training.batch.check_rollout`) or that has nothing trained, a reward that is not
a finite number — each is counted in `MinedPairs.malformed` and skipped. A self-summarizing rollout
(several context segments, each its own sequence) has no single token sequence to be a pair side: it is
counted in `MinedPairs.segmented` and skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus
from rlbus.bus.claimcheck import ClaimCheckBus, payload
from rlbus.bus.replay import read_window
from rlbus.bus.topic import Topic
from rlbus.bus.topics import REWARDS, ROLLOUTS
from rlbus.bus.types import Record
from rlbus.errors import SchemaError
from rlbus.schemas import Reward, Rollout
from rlbus.training.batch import check_rollout
from rlbus.training.preference import PreferencePair
from rlbus.training.sft import SFTExample


@dataclass(frozen=True)
class Episode:
    """What a pair needs of one rollout copy: its place in the group and its tokens (the log-probs,
    versions and routing are dropped at once, so mining a long log holds only tokens)."""

    rollout_id: str
    prompt_id: str
    group_index: int
    created_at: float
    example: SFTExample

    @classmethod
    def from_rollout(cls, rollout: Rollout) -> Episode | None:
        """ValueError when the rollout's arrays are inconsistent, not inline, or nothing is trained; None
        for a self-summarizing rollout (several context segments: no single sequence a pair side can be)."""
        if len(check_rollout(rollout)) > 1:
            return None
        ids = rollout.token_ids.to_numpy()
        mask = rollout.loss_mask.to_numpy()
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise ValueError(f"rollout {rollout.rollout_id}: token_ids {ids.shape} vs loss_mask {mask.shape}")
        try:
            example = SFTExample(tuple(int(t) for t in ids), tuple(bool(m) for m in mask))
        except ValueError as exc:
            raise ValueError(f"rollout {rollout.rollout_id}: {exc}") from None
        return cls(rollout.rollout_id, rollout.prompt_id, rollout.group_index, rollout.created_at, example)

    @property
    def context(self) -> tuple[int, ...]:
        """The tokens before the first trained one: the prompt both sides of a pair must share."""
        return self.example.token_ids[: self.example.trained.index(True)]


@dataclass
class GroupCounts:
    """How `pairs_from_groups` disposed of the groups it saw."""

    groups: int = 0
    """Prompt groups (distinct ``prompt_id``)."""
    incomplete: int = 0
    """Groups with fewer than two scored rollouts."""
    no_contrast: int = 0
    """Groups whose best − worst reward is not above the margin (all rewards equal, for margin 0)."""
    context_mismatch: int = 0
    """Groups whose best and worst rollout differ before their first trained token."""
    over_limit: int = 0
    """Groups that had a pair after ``max_pairs`` were already made."""


@dataclass
class MinedPairs(GroupCounts):
    """The pairs of a run's log and what was read to make them."""

    pairs: list[PreferencePair] = field(default_factory=list)
    rollouts: int = 0
    """Rollout records read (every copy, malformed ones included)."""
    rewards: int = 0
    """Reward records read."""
    malformed: int = 0
    """Records that did not decode, rollouts that cannot be a pair side, rewards that are not finite."""
    unmatched_rewards: int = 0
    """Counted rewards whose rollout (or named copy) is not on the log."""
    segmented: int = 0
    """Rollout records left out for having several context segments (self-summarization)."""

    @property
    def skipped(self) -> int:
        """Records and groups left out: malformed and segmented records plus context mismatches."""
        return self.malformed + self.segmented + self.context_mismatch

    def summary(self) -> dict[str, int]:
        return {
            "rollouts read": self.rollouts, "rewards read": self.rewards, "groups": self.groups,
            "pairs": len(self.pairs), "no contrast": self.no_contrast, "incomplete": self.incomplete,
            "context mismatch": self.context_mismatch, "malformed": self.malformed,
            "unmatched rewards": self.unmatched_rewards, "segmented": self.segmented,
            "over max-pairs": self.over_limit,
        }


def pairs_from_groups(
    scored: Iterable[tuple[Episode, Mapping[str, float]]],
    *,
    margin: float = 0.0,
    max_pairs: int | None = None,
    counts: GroupCounts | None = None,
) -> list[PreferencePair]:
    """One (best, worst) pair per prompt group (see the module docstring), groups in first-seen order.

    ``scored`` gives each rollout with its reward per source (empty: not scored); the reward compared
    is the sum over sources, counting only rollouts scored by every source seen in the group. Counts go
    to ``counts`` when given.
    """
    counts = counts if counts is not None else GroupCounts()
    groups: dict[str, list[tuple[Episode, Mapping[str, float]]]] = {}
    for episode, rewards in scored:
        groups.setdefault(episode.prompt_id, []).append((episode, rewards))
    pairs: list[PreferencePair] = []
    for prompt_id, members in groups.items():
        counts.groups += 1
        sources = set().union(*(r.keys() for _, r in members))
        ranked = sorted(
            ((sum(r.values()), e) for e, r in members if sources and r.keys() >= sources),
            key=lambda item: (item[1].group_index, item[1].rollout_id),
        )
        if len(ranked) < 2:
            counts.incomplete += 1
            continue
        best_reward, best = max(ranked, key=lambda item: item[0])  # max/min keep the first of equals
        worst_reward, worst = min(ranked, key=lambda item: item[0])
        if not best_reward - worst_reward > margin:
            counts.no_contrast += 1
        elif best.context != worst.context:
            counts.context_mismatch += 1
        elif max_pairs is not None and len(pairs) >= max_pairs:
            counts.over_limit += 1
        else:
            pairs.append(PreferencePair(best.example, worst.example, prompt_id, best_reward, worst_reward))
    return pairs


def _decode(record: Record[Any], topic: Topic[Any]) -> Any:
    """The record's message, decoded with ``topic``'s schema whatever name it was read under (a run's
    namespaced ``run7.rl.rollouts.v1`` on a plain bus too); claims resolved by a ClaimCheckBus."""
    return topic.decode(payload(record))


async def mine_pairs(
    bus: Bus,
    *,
    rollouts_topic: str = ROLLOUTS.name,
    rewards_topic: str = REWARDS.name,
    reward_source: str | None = None,
    margin: float = 0.0,
    max_pairs: int | None = None,
    store: BlobStore | None = None,
) -> MinedPairs:
    """Replay ``rewards_topic`` then ``rollouts_topic`` to their end offsets and mine the pairs (see the
    module docstring). ``store`` resolves claim-checked records (the run's blob store); ``bus`` must
    be started."""
    if store is not None:
        bus = ClaimCheckBus(bus, store)
    mined = MinedPairs()
    rewards: list[Reward] = []
    async for record in read_window(bus, rewards_topic):
        mined.rewards += 1
        try:
            reward: Reward = _decode(record, REWARDS)
        except SchemaError:
            mined.malformed += 1
            continue
        if not math.isfinite(reward.value):
            mined.malformed += 1
        elif reward_source is None or reward.source == reward_source:
            rewards.append(reward)

    copies: dict[str, list[Episode]] = {}
    async for record in read_window(bus, rollouts_topic):
        mined.rollouts += 1
        try:
            episode = Episode.from_rollout(_decode(record, ROLLOUTS))
        except (SchemaError, ValueError):
            mined.malformed += 1
            continue
        if episode is None:
            mined.segmented += 1
            continue
        copies.setdefault(episode.rollout_id, []).append(episode)

    scores: dict[tuple[str, int], dict[str, float]] = {}
    for reward in rewards:
        found = copies.get(reward.rollout_id, [])
        index = _copy_of(found, reward.rollout_created_at)
        if index is None:
            mined.unmatched_rewards += 1
            continue
        scores.setdefault((reward.rollout_id, index), {})[reward.source] = reward.value

    joined: list[tuple[Episode, Mapping[str, float]]] = []
    for rollout_id, found in copies.items():
        scored = [i for i in range(len(found)) if (rollout_id, i) in scores]
        index = _newest(found, scored) if scored else _newest(found, range(len(found)))
        joined.append((found[index], scores.get((rollout_id, index), {})))
    mined.pairs = pairs_from_groups(joined, margin=margin, max_pairs=max_pairs, counts=mined)
    return mined


def _copy_of(copies: list[Episode], created_at: float | None) -> int | None:
    """The copy a reward scored: the one created at ``created_at`` (the last such), else the newest."""
    if not copies:
        return None
    if created_at is None:
        return _newest(copies, range(len(copies)))
    matching = [i for i, e in enumerate(copies) if e.created_at == created_at]
    return matching[-1] if matching else None


def _newest(copies: list[Episode], among: Iterable[int]) -> int:
    """Index of the copy with the largest ``created_at`` among ``among``, the later one on a tie."""
    return max(among, key=lambda i: (copies[i].created_at, i))
