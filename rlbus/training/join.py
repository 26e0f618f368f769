"""The trainer's join: rollouts ⨝ rewards by rollout id, grouped by prompt, in the state store.

Rollouts (keyed by prompt) and rewards (keyed by rollout) arrive on different topics and partitions, in
any order, possibly twice. Each arrival is written into the group's buffer entry (Redis hash or
in-memory) so a restarted trainer resumes where it was; a group is *ready* when all ``group_size``
rollouts have a reward from every source the reward policy waits for. A group still open after
``timeout_s`` is released with what it has — trained if at least ``min_group`` rollouts are fully
scored, the rest dropped with a reason. Every rollout ends in exactly one :class:`Outcome`, counted in
the store: the first outcome recorded for an id is final, a rollout id that already has one is ignored
on arrival and counted as a duplicate, never trained twice or dropped after it was trained. A reward
whose value is not a finite number is refused (``MalformedMessage``, so the trainer dead-letters it)
before it can turn a whole batch's advantages into NaN.

Readiness is decided from field names, never rollout or reward values. An arrival is one round trip
whatever G is (G = 16–128 in real runs): one atomic merge (`StateStore.merge_fields`) that does nothing if
the rollout already has an outcome, else writes the arrival (a rollout only where no copy of it is
buffered yet), opens the group if it is new and answers with the group's meta and field count. Only when
that count could hold a complete group (``1 + G·(2 + sources)`` fields) are the names (and the copies'
creation times) read, and only when they show every rollout scored by every source is the group read and
decoded — once, at release. A group of G rollouts costs O(G), not O(G²). Being one script, the merge also
closes the window in which a rollout given its outcome between a check and a write was buffered again.

Redelivered prompts. A rollout worker that dies after publishing part of a group has its prompt played
again, under the same rollout ids but with other tokens. The first copy of a rollout id stays in the
buffer (later copies are counted in ``join:redelivered``), and each reward names the copy it scored
(``Reward.rollout_created_at``), so a rollout is only ever paired with its own reward. Rewards that do
not name a copy (user feedback) match any.

Invalid judgements. An LM judge that could not produce a readable score publishes its reward with
``metadata["judge_valid"] = "false"`` (`rlbus.rewards.judge`); every one that arrives is counted
(``join:invalid_judgements``) and it never overwrites a valid reward of the same rollout and source. The
policy's ``invalid`` says what happens next: ``drop`` — the rollout is scored (the group completes) but
flagged, and the trainer records it as ``dropped_invalid_judgement`` instead of training it; ``downweight``
— it trains with the judgement pulled towards its group's mean (`judged_group`); ``wait`` — the
judgement is set aside under ``x:`` and the rollout waits for a valid one (another judge worker's), or
the join's timeout. These rules live in their own functions and fields, apart from the join itself.

Reward hacking. A scored rollout carries the kinds of hacking its rewards report (`ScoredRollout.hacks`:
`Reward.hack_kinds` of the sources the policy waits for); its value is already what the reward worker's
``hack_policy`` made of it, and the trainer reports the share of hacked rollouts per step.

Trained with the checkpoint. A trainer that checkpoints (``checkpoint_every`` steps) holds the rollouts of
each step in ``ns:held`` (rollout id → step) *before* the step runs, and enters them in the ledger as
trained only once a checkpoint containing that step is written (:meth:`JoinBuffer.settle`). At start-up
(:meth:`JoinBuffer.recover`) the restored checkpoint's step decides: held at or before it → trained (the
checkpoint was written, the settle was not); after it → released again, because their update died with
the process. So the ledger's "trained" is exactly the model's: no update lost, none applied twice. Only a
join that keeps a released group's data until its rollouts have outcomes can hold
(:attr:`JoinBuffer.keeps_released`, the ordered join); the plain join drops the data on release, so its
trainer records at once.

Store layout (``ns`` = namespace)::

    ns:group:<prompt_id>   meta → {"group_size", "first_seen"}; r:<rollout_id> → Rollout bytes;
                           c:<rollout_id> → which copy r: holds (its created_at, for readiness without
                           reading r:); w:<rollout_id>:<source>:<copy> → Reward bytes
                           (copy: the scored rollout's created_at, "" when the reward names none);
                           x:<rollout_id>:<source>:<copy> → an invalid judgement set aside (policy "wait")
    ns:open                <prompt_id> → first-seen time (the groups the sweeper looks at)
    ns:held                <rollout_id> → step: trained, waiting for the checkpoint that holds the step
    ledger "outcome"       every rollout id that reached an outcome (SET NX): the exactly-once gate
    ledger <outcome>       the ids per outcome ("trained", "dropped_stale" …), for audits
    counters outcome:<name>, join:invalid_judgements (invalid judgements that arrived),
             ledger:trained_again (a training the gate caught only afterwards),
             ledger:rolled_back (held rollouts released again after a crash)
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from rlbus.errors import MalformedMessage
from rlbus.schemas import Reward, Rollout, decode, encode
from rlbus.state.base import Merged, StateStore
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER, outcome_counter

log = logging.getLogger("rlbus.training.join")


class Outcome(StrEnum):
    TRAINED = "trained"
    STALE = "dropped_stale"
    TIMED_OUT = "dropped_timed_out"
    INCOMPLETE = "dropped_incomplete_group"
    DEAD_LETTERED = "dead_lettered"
    DUPLICATE = "duplicate"
    #: A served rollout past the online age bound (``max_age_s``): unrated that long, or rated too late.
    TOO_OLD = "dropped_too_old"
    INVALID_JUDGEMENT = "dropped_invalid_judgement"


#: Ledger namespace holding every rollout id that has reached an outcome (the exactly-once gate).
FINAL = "outcome"
#: Counter of rollouts passed to the optimizer although they already had an outcome; must stay 0.
TRAINED_AGAIN = "ledger:trained_again"
#: Held rollouts released again at a restart because the checkpoint did not hold their step.
ROLLED_BACK = "ledger:rolled_back"
#: Second copies of buffered rollouts (a prompt redelivered after a crash, played again under the same ids).
REDELIVERED_COUNTER = "join:redelivered"
#: Invalid judgements (``judge_valid = "false"``) of a source the policy waits for, as they arrived.
INVALID_COUNTER = "join:invalid_judgements"


@dataclass(frozen=True)
class RewardPolicy:
    """Which reward sources the trainer waits for and how it combines them."""

    #: Sources every rollout needs before its group is ready (e.g. ``("verifier",)``, ``("verifier", "judge")``).
    sources: tuple[str, ...] = ("verifier",)
    #: Weight of each source in the scalar reward (missing → 1.0).
    weights: dict[str, float] = field(default_factory=dict)
    #: Seconds after a group's first message before it is released incomplete.
    timeout_s: float = 300.0
    #: A timed-out group still trains if at least this many rollouts are fully scored.
    min_group: int = 2
    #: What an invalid judgement (`rlbus.rewards.judge`) does to its rollout: ``drop`` it (the trainer records
    #: `Outcome.INVALID_JUDGEMENT`), ``downweight`` it (see `judged_group`), or ``wait`` for a valid one
    #: (kept aside in an ``x:`` field, so readiness does not count it; a timeout drops the rollout).
    invalid: Literal["drop", "downweight", "wait"] = "drop"
    #: With ``downweight``: the share of an invalid judgement's own value that counts (the rest: its group's
    #: mean valid value of the source), see `judged_group`.
    invalid_weight: float = 0.0

    def combine(self, rewards: dict[str, Reward]) -> float:
        return sum(self.weights.get(source, 1.0) * rewards[source].value for source in self.sources)

    def drops(self, scored: ScoredRollout) -> bool:
        """Whether the trainer drops this rollout for an invalid judgement."""
        return self.invalid == "drop" and bool(scored.invalid)


@dataclass(frozen=True)
class ScoredRollout:
    rollout: Rollout
    reward: float
    components: dict[str, float]
    #: Sources whose reward is an invalid judgement (`rlbus.rewards.judge.is_valid`), handled per the policy.
    invalid: tuple[str, ...] = ()
    #: Kinds of reward hacking its rewards report (`Reward.hack_kinds`), for the trainer's ``hacked`` share.
    hacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScoredGroup:
    prompt_id: str
    rollouts: list[ScoredRollout]
    #: Rollout ids of the group that were not fully scored (only for a timed-out group).
    unscored: list[str] = field(default_factory=list)

    @property
    def rollout_ids(self) -> list[str]:
        return [s.rollout.rollout_id for s in self.rollouts]


class JoinBuffer:
    #: Whether a released group's data stays in the store until each of its rollouts has an outcome — the
    #: precondition for holding trained rollouts until a checkpoint (see the module docstring).
    keeps_released = False

    def __init__(
        self,
        *,
        state: StateStore,
        policy: RewardPolicy,
        namespace: str = "join",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._state = state
        self.policy = policy
        self._ns = namespace
        self._clock = clock
        self._ttl = max(policy.timeout_s * 4, 60.0)
        self._holding: dict[str, int] | None = None

    def _group_key(self, prompt_id: str) -> str:
        return f"{self._ns}:group:{prompt_id}"

    async def _merge(
        self, prompt_id: str, rollout_id: str, fields: dict[str, bytes], first: dict[str, bytes]
    ) -> tuple[Merged, dict[str, float]]:
        """Write an arrival in one round trip, unless its rollout already has an outcome: ``fields``, and
        ``first`` where absent (with the group's opening meta); returns what was written and the group's
        meta. A group seen for the first time is also indexed for the timeout sweep."""
        now = self._clock()
        merged = await self._state.merge_fields(
            self._group_key(prompt_id), fields, self._ttl,
            if_absent={**first, "meta": json.dumps({"first_seen": now}).encode()}, read=("meta",),
            unless=(FINAL, rollout_id),
        )
        if merged.skipped:
            return merged, {}
        if "meta" in merged.added:
            await self._state.put_field(f"{self._ns}:open", prompt_id, str(now).encode(), None)
        meta: dict[str, float] = json.loads(merged.read["meta"])
        return merged, meta

    async def add_rollout(self, rollout: Rollout) -> ScoredGroup | None:
        """Buffer a rollout; returns its group if that made the group ready."""
        name = f"r:{rollout.rollout_id}"
        first = {name: encode(rollout), f"c:{rollout.rollout_id}": repr(rollout.created_at).encode()}
        merged, meta = await self._merge(rollout.prompt_id, rollout.rollout_id, {}, first)
        if merged.skipped:  # it already has an outcome: a redelivery
            await self._state.incr(outcome_counter(Outcome.DUPLICATE))
            return None
        if name not in merged.added:  # a redelivered prompt's second copy: the first one stays
            await self._state.incr(REDELIVERED_COUNTER)
            return None
        count = merged.size
        if meta.get("group_size") != rollout.group_size:  # the group's first rollout (rewards may come first)
            meta["group_size"] = rollout.group_size
            count = await self._state.put_fields(self._group_key(rollout.prompt_id),
                                                 {"meta": json.dumps(meta).encode()}, self._ttl)
        return await self._ready(rollout.prompt_id, meta, count)

    async def add_reward(self, reward: Reward) -> ScoredGroup | None:
        """Buffer a reward; rewards of sources the policy does not wait for are ignored. Raises
        MalformedMessage for a value (or component) that is not a finite number."""
        if not math.isfinite(reward.value) or not all(math.isfinite(v) for v in reward.components.values()):
            raise MalformedMessage(f"reward {reward.reward_id} for {reward.rollout_id}: value {reward.value} "
                                   "or a component is not a finite number")
        if reward.source not in self.policy.sources:
            return None
        if reward.metadata.get("judge_valid") == "false":
            await self._state.incr(INVALID_COUNTER)
        copy = "" if reward.rollout_created_at is None else repr(reward.rollout_created_at)
        field = f"{self._reward_prefix(reward)}{reward.rollout_id}:{reward.source}:{copy}"
        arrival = {field: encode(reward)}
        valid = reward.metadata.get("judge_valid") != "false"  # an invalid judgement never replaces a valid one
        merged, meta = await self._merge(reward.prompt_id, reward.rollout_id, arrival if valid else {},
                                         {} if valid else arrival)
        if merged.skipped:  # its rollout already has an outcome
            return None
        return await self._ready(reward.prompt_id, meta, merged.size)

    def _reward_prefix(self, reward: Reward) -> str:
        """``w:`` — or ``x:`` for an invalid judgement the policy waits past, which readiness ignores."""
        if reward.metadata.get("judge_valid") != "false":
            return "w:"
        return "x:" if self.policy.invalid == "wait" else "w:"

    def _assemble(self, prompt_id: str, fields: dict[str, bytes]) -> ScoredGroup:
        rollouts = {k[2:]: decode(Rollout, v) for k, v in fields.items() if k.startswith("r:")}
        rewards: dict[str, dict[str, Reward]] = {}
        for k, v in fields.items():
            if k.startswith("w:"):
                rollout_id, source, copy = k[2:].rsplit(":", 2)
                rollout = rollouts.get(rollout_id)
                if copy and rollout is not None and copy != repr(rollout.created_at):
                    continue  # it scored another copy of this rollout (a redelivered prompt)
                rewards.setdefault(rollout_id, {})[source] = decode(Reward, v)
        scored, unscored = [], []
        for rollout_id, rollout in sorted(rollouts.items(), key=lambda kv: kv[1].group_index):
            got = rewards.get(rollout_id, {})
            if all(source in got for source in self.policy.sources):
                components = {f"{s}.{name}": value for s, r in got.items() for name, value in r.components.items()}
                components.update({s: got[s].value for s in self.policy.sources})
                invalid = tuple(s for s in self.policy.sources if got[s].metadata.get("judge_valid") == "false")
                hacks = tuple(dict.fromkeys(kind for s in self.policy.sources for kind in got[s].hack_kinds))
                scored.append(ScoredRollout(rollout, self.policy.combine(got), components, invalid, hacks))
            else:
                unscored.append(rollout_id)
        return judged_group(self.policy, ScoredGroup(prompt_id, scored, unscored))

    async def _complete(self, prompt_id: str, meta: dict[str, float], count: int) -> bool:
        """Whether every rollout of the group is scored by every source — from the field count, then
        the field names and the copies' creation times; no rollout or reward is read."""
        size = meta.get("group_size")
        if size is None or count < 1 + size * (2 + len(self.policy.sources)):
            return False
        key = self._group_key(prompt_id)
        names = await self._state.field_names(key)
        copies = await self._state.get_named(key, [n for n in names if n.startswith("c:")])
        return len(scored_from_names(names, copies, self.policy.sources)) >= size

    async def _read(self, prompt_id: str) -> ScoredGroup:
        """The group as buffered, rollouts and rewards decoded (once per release)."""
        return self._assemble(prompt_id, await self._state.get_fields(self._group_key(prompt_id)))

    async def _ready(self, prompt_id: str, meta: dict[str, float], count: int) -> ScoredGroup | None:
        """After an arrival that left ``count`` fields in the group: the group, released, if it is complete."""
        if not await self._complete(prompt_id, meta, count):
            return None
        group = await self._read(prompt_id)
        await self._close(prompt_id)
        return group

    async def _close(self, prompt_id: str) -> None:
        await self._state.delete(self._group_key(prompt_id))
        await self._state.delete_field(f"{self._ns}:open", prompt_id)

    async def expire(self) -> list[ScoredGroup]:
        """Release groups older than the timeout: the trainable ones are returned (with ``unscored`` set);
        their unscored rollouts, and whole groups below ``min_group``, are recorded as dropped."""
        now = self._clock()
        released = []
        for prompt_id, first_seen in (await self._state.get_fields(f"{self._ns}:open")).items():
            if now - float(first_seen) < self.policy.timeout_s:
                continue
            group = await self._read(prompt_id)
            await self._close(prompt_id)
            if len(group.rollouts) >= self.policy.min_group:
                await self.record(Outcome.TIMED_OUT, group.unscored)
                released.append(group)
            else:
                await self.record(Outcome.INCOMPLETE, group.rollout_ids + group.unscored)
                await self.free_groups(1)
        return released

    async def free_groups(self, count: int) -> None:
        """``count`` groups ended here without reaching the trainer: they count as done, and each frees its
        admission slot (`rlbus.producers.prompts`, "Groups that end untrained")."""
        if count > 0:
            await self._state.incr(GROUPS_DONE_COUNTER, count)
            await self._state.incr(GROUPS_FREED_COUNTER, count)

    async def record(self, outcome: Outcome, rollout_ids: Iterable[str]) -> int:
        """Enter rollouts' outcome in the ledger and count it. Returns how many were new — an id that
        already has an outcome keeps it and is counted as a duplicate instead (and, when it was just
        trained, in ``ledger:trained_again``: the trainer must never let that happen). The gate, the
        outcome's set and its counter change in one atomic store call (`StateStore.mark_once_counted`):
        a process killed mid-record leaves all three or none."""
        repeats = [outcome_counter(Outcome.DUPLICATE), *([TRAINED_AGAIN] if outcome is Outcome.TRAINED else [])]
        new = await self._state.mark_once_counted(
            FINAL, list(rollout_ids), also=[outcome], counter=outcome_counter(outcome), repeats=repeats
        )
        return sum(new)

    # --- trained with the checkpoint ----------------------------------------------------------------------
    @property
    def held_key(self) -> str:
        return f"{self._ns}:held"

    async def held(self) -> dict[str, int]:
        """Rollouts trained but not yet in a checkpoint: rollout id → the step that trains them."""
        if self._holding is None:  # one trainer writes these; read the store once, then mirror it
            self._holding = {rid: int(step) for rid, step in (await self._state.get_fields(self.held_key)).items()}
        return self._holding

    async def hold(self, step: int, rollout_ids: Iterable[str]) -> None:
        """``rollout_ids`` go into step ``step``; written *before* the step runs, so a checkpoint that
        contains the step always finds them here."""
        holding = await self.held()
        for rollout_id in rollout_ids:
            await self._state.put_field(self.held_key, rollout_id, str(step).encode(), None)
            holding[rollout_id] = step

    async def settle(self, step: int, *, only: Collection[str] | None = None) -> int:
        """A checkpoint at ``step`` is written: rollouts held at steps ≤ ``step`` (and in ``only``, when
        given) become trained in the ledger. Safe to repeat (a crash between the ledger and the cleanup).
        Returns how many were new."""
        holding = await self.held()
        done = [rid for rid, at in holding.items() if at <= step and (only is None or rid in only)]
        fresh = [r for r in done if not await self._state.seen(Outcome.TRAINED, r)]
        counted = await self.record(Outcome.TRAINED, fresh)
        for rollout_id in done:
            await self._state.delete_field(self.held_key, rollout_id)
            holding.pop(rollout_id, None)
        return counted

    async def recover(self, step: int) -> list[str]:
        """At start-up, with the model restored at ``step`` (0: no checkpoint): settle what it holds and
        release the rest to be trained again — its update died with the previous process. Returns the
        rollout ids released again."""
        self._holding = None
        await self.settle(step)
        holding = await self.held()
        again = sorted(holding)
        for rollout_id in again:
            await self._state.delete_field(self.held_key, rollout_id)
        holding.clear()
        if again:
            await self._state.incr(ROLLED_BACK, len(again))
            log.warning("%d rollout(s) trained after the checkpoint at step %d lost their update with the "
                        "previous trainer; they will be trained again", len(again), step)
        return again

    async def outcome_of(self, rollout_id: str) -> list[Outcome]:
        """Every outcome the ledger holds for ``rollout_id`` (one, when the exactly-once gate held)."""
        final = [o for o in Outcome if o is not Outcome.DUPLICATE]
        return [o for o in final if await self._state.seen(o, rollout_id)]

    async def counts(self) -> dict[str, int]:
        return {o.value: await self._state.get_counter(outcome_counter(o)) for o in Outcome}


def scored_from_names(names: Iterable[str], copies: Mapping[str, bytes], sources: Sequence[str]) -> set[str]:
    """Rollout ids of a group that have a reward from every source for the copy buffered, from the field
    names and the ``c:<rollout_id>`` fields (the buffered copy's created_at): the names-only twin of
    :meth:`JoinBuffer._assemble`'s pairing."""
    buffered = {name[2:]: value.decode() for name, value in copies.items()}
    got: dict[str, set[str]] = {}
    for name in names:
        if name.startswith("w:"):
            rollout_id, source, copy = name[2:].rsplit(":", 2)
            if rollout_id in buffered and (not copy or copy == buffered[rollout_id]):
                got.setdefault(rollout_id, set()).add(source)
    need = set(sources)
    return {rollout_id for rollout_id, have in got.items() if need <= have}


# --- served traffic ------------------------------------------------------------------------------------------
#: Counter of served rollouts that expired without any rating (a subset of ``outcome:dropped_too_old``).
SERVED_UNRATED = "join:served_unrated"


def is_served(rollout: Rollout) -> bool:
    """Whether ``rollout`` was served to a user (the gateway's contract: ``metadata.origin = "served"``)."""
    return rollout.metadata.get("origin") == "served"


class ServedJoin:
    """The join of served rollouts: one rollout (group_size 1) ⨝ its user reward, by rollout id.

    Served traffic has no groups and its rewards come minutes or hours later, if at all, so it cannot wait
    in a prompt's group (the GRPO join's timeout would drop it within a minute, and a task key shared by
    many sessions is no group). Each served rollout gets its own entry; the first reward of a source in
    ``sources`` releases it (whichever comes second, rollout or reward). A released rollout stays in the
    store, indexed in ``ns:served:ready``, until the ledger gives it an outcome (`discard`, or the sweep
    in `expire` once it is final), so a trainer restart requeues what it had released but not trained
    (`pending`); unreleased rollouts wait in the store as the GRPO join's do. A rollout unrated after
    ``max_age_s`` is dropped as :attr:`Outcome.TOO_OLD` (and counted in ``join:served_unrated``).

    Store layout (``ns`` = the GRPO join's namespace; the ledger is shared)::

        ns:served:<rollout_id>   r → Rollout bytes; w:<source> → Reward bytes (the last of each source)
        ns:served:open           <rollout_id> → created_at: buffered, waiting for a reward (the age sweep)
        ns:served:ready          <rollout_id> → release time: released, waiting for an outcome
    """

    def __init__(
        self, *, ledger: JoinBuffer, state: StateStore, sources: Sequence[str], max_age_s: float,
        namespace: str = "join", clock: Callable[[], float] = time.time,
    ) -> None:
        if not sources or max_age_s <= 0:
            raise ValueError("a served join needs reward sources and max_age_s > 0")
        self._ledger = ledger
        self._state = state
        self.sources = tuple(sources)
        self.max_age_s = max_age_s
        self._ns = f"{namespace}:served"
        self._clock = clock
        self._ttl = max_age_s * 1.5 + 60.0  # outlives the age sweep, so the sweep is what drops an entry

    def _key(self, rollout_id: str) -> str:
        return f"{self._ns}:{rollout_id}"

    @property
    def open_key(self) -> str:
        return f"{self._ns}:open"

    @property
    def ready_key(self) -> str:
        return f"{self._ns}:ready"

    async def add_rollout(self, rollout: Rollout) -> ScoredRollout | None:
        """Buffer a served rollout; returns it scored if its reward was already here."""
        rid = rollout.rollout_id
        merged = await self._state.merge_fields(self._key(rid), {}, self._ttl, if_absent={"r": encode(rollout)},
                                                unless=(FINAL, rid))
        if merged.skipped:
            await self._state.incr(outcome_counter(Outcome.DUPLICATE))
            return None
        if "r" not in merged.added:  # a second copy (a redelivery): the first stays
            await self._state.incr(REDELIVERED_COUNTER)
            return None
        await self._state.put_field(self.open_key, rid, repr(rollout.created_at).encode(), None)
        return await self._release(rid)

    async def add_reward(self, reward: Reward) -> ScoredRollout | None:
        """Buffer a reward for a served rollout (any rollout id: it may come before its rollout, or be for an
        RL rollout, and then simply expires); returns the rollout scored when it is buffered. Raises
        MalformedMessage for a value that is not a finite number."""
        if not math.isfinite(reward.value):
            raise MalformedMessage(f"reward {reward.reward_id} for {reward.rollout_id}: value {reward.value} "
                                   "is not a finite number")
        if reward.source not in self.sources:
            return None
        rid = reward.rollout_id
        merged = await self._state.merge_fields(self._key(rid), {f"w:{reward.source}": encode(reward)}, self._ttl,
                                                unless=(FINAL, rid))
        if merged.skipped:
            return None
        return await self._release(rid)

    async def _release(self, rollout_id: str) -> ScoredRollout | None:
        """The rollout scored, once: when it and a reward are buffered and it is not released already."""
        names = await self._state.field_names(self._key(rollout_id))
        if "r" not in names or not any(n.startswith("w:") for n in names):
            return None
        if await self._state.get_named(self.ready_key, [rollout_id]):
            return None
        await self._state.put_field(self.ready_key, rollout_id, repr(self._clock()).encode(), None)
        await self._state.delete_field(self.open_key, rollout_id)
        return await self._read(rollout_id)

    async def _read(self, rollout_id: str) -> ScoredRollout | None:
        fields = await self._state.get_fields(self._key(rollout_id))
        if "r" not in fields:
            return None
        rewards = {name[2:]: decode(Reward, v) for name, v in fields.items() if name.startswith("w:")}
        source = next((s for s in self.sources if s in rewards), None)
        if source is None:
            return None
        got = rewards[source]
        components = {f"{source}.{k}": v for k, v in got.components.items()} | {source: got.value}
        return ScoredRollout(decode(Rollout, fields["r"]), got.value, components, hacks=got.hack_kinds)

    async def discard(self, rollout_ids: Iterable[str]) -> None:
        """Forget released rollouts whose outcome the ledger now holds."""
        for rid in rollout_ids:
            await self._state.delete(self._key(rid))
            await self._state.delete_field(self.ready_key, rid)

    async def expire(self) -> int:
        """The age sweep: drop unrated rollouts older than ``max_age_s`` (:attr:`Outcome.TOO_OLD`) and forget
        released ones that have an outcome. Returns how many were dropped."""
        now = self._clock()
        old = [rid for rid, created in (await self._state.get_fields(self.open_key)).items()
               if now - float(created) > self.max_age_s]
        dropped = await self._ledger.record(Outcome.TOO_OLD, old)
        if dropped:
            await self._state.incr(SERVED_UNRATED, dropped)
            log.info("%d served rollout(s) unrated after %.0f s dropped", dropped, self.max_age_s)
        for rid in old:
            await self._state.delete_field(self.open_key, rid)
            await self._state.delete(self._key(rid))
        done = [rid for rid in await self._state.field_names(self.ready_key) if await self._state.seen(FINAL, rid)]
        await self.discard(done)
        return dropped

    async def pending(self) -> list[ScoredRollout]:
        """At start-up: released rollouts without an outcome (their training died with the previous
        process), oldest release first; those that have one are forgotten."""
        ready = await self._state.get_fields(self.ready_key)
        out = []
        for rid, _ in sorted(ready.items(), key=lambda kv: float(kv[1])):
            if await self._state.seen(FINAL, rid):
                await self.discard([rid])
                continue
            scored = await self._read(rid)
            if scored is None:  # its entry expired: nothing left to train
                await self._state.delete_field(self.ready_key, rid)
                continue
            out.append(scored)
        return out

    async def waiting(self) -> int:
        """Served rollouts buffered and not yet rated."""
        return len(await self._state.field_names(self.open_key))


# --- invalid judgements (rlbus.rewards.judge) ---------------------------------------------------------------
def judged_group(policy: RewardPolicy, group: ScoredGroup) -> ScoredGroup:
    """``group`` with the policy's ``downweight`` rule applied to rollouts holding an invalid judgement: the
    invalid source's value becomes ``invalid_weight`` × its own value (the dimensions that did parse, 0.0
    when none did) + (1 − ``invalid_weight``) × the mean of that source's valid values in the group (0.0
    when none is valid). At the default weight 0 an invalid judgement is neutral — its rollout's advantage
    comes from the other sources alone, neither rewarded nor punished by the broken judgement. ``drop`` is
    the trainer's (`RewardPolicy.drops`); ``wait`` never releases an invalid judgement as a reward."""
    if policy.invalid != "downweight" or not any(s.invalid for s in group.rollouts):
        return group
    means: dict[str, float] = {}
    for source in policy.sources:
        valid = [s.components[source] for s in group.rollouts if source not in s.invalid]
        means[source] = sum(valid) / len(valid) if valid else 0.0
    rollouts = []
    for s in group.rollouts:
        if not s.invalid:
            rollouts.append(s)
            continue
        reward = 0.0
        for source in policy.sources:
            value = s.components[source]
            if source in s.invalid:
                value = policy.invalid_weight * value + (1.0 - policy.invalid_weight) * means[source]
            reward += policy.weights.get(source, 1.0) * value
        rollouts.append(ScoredRollout(s.rollout, reward, s.components, s.invalid, s.hacks))
    return ScoredGroup(group.prompt_id, rollouts, group.unscored)
