"""The trainer's in-order release: complete groups go to training in prompt order, whole batches at a time.

Why. Which groups the trainer puts into step k depends, with a plain join, on the order rollouts and
rewards happen to arrive across 24 partitions of two topics — a fact of one run's timing that no replay
can reproduce. Kafka keeps order only within a partition. The one total order the data itself carries is
the prompt producer's: every prompt of a run is stamped with a sequence number (``metadata["seq"]``, see
:func:`stamp`), and this join hands complete groups to the trainer in that order and only in whole
batches of ``batch`` groups. Step k then trains the k-th run of ``batch`` consecutive resolved prompts,
whatever the timing — so a fresh trainer fed the same rollouts and rewards (``rlbus replay``) trains
the same groups, rollout ids and rewards at every step, and makes the same staleness decisions (the
trainer's version advances once per step in both runs). This is the ordering of a synchronous RL loop;
generation, scoring and training still overlap, and admission control keeps ``(max_staleness + 2) ×
batch`` prompts in flight, so waiting for the oldest group costs little.

Rules, applied on every :meth:`expire` call (the trainer calls it every few hundred milliseconds):

* A complete group (every rollout scored by every source) stays in the store — persistent, no TTL —
  and is indexed in ``<ns>:complete`` with its sequence number, instead of being returned at once.
* The cursor ``<ns>:next_seq`` (a counter in the store) is the next sequence number to release. From it,
  the run of consecutive sequence numbers whose groups are complete (or were released by the join's
  timeout, or were dropped whole by it) is releasable; so are groups without a sequence number (another
  producer) or behind the cursor (late, or left over by a crash): those go first.
* Only ``⌊n / batch⌋ × batch`` of the ``n`` releasable groups go out, so the trainer never holds a
  partial batch in memory: anything not yet trained is in the store, and a stopped or crashed trainer
  resumes without losing a group.
* A released group's data is deleted once every rollout in it has an outcome (the trainer records
  ``trained`` or ``dropped_stale`` for each), not before: a trainer that dies mid-step finds the group
  again after a restart, behind the cursor, and releases it first, minus the rollouts the ledger already
  has an outcome for.
* A sequence number that never shows up — its prompt was dead-lettered before any rollout existed, or
  the producer crashed before persisting its counter — would block the cursor forever. When nothing at
  all has arrived for it while later groups wait, for ``gap_timeout_s`` (default: the join timeout),
  the cursor jumps to the next sequence number that exists, and the jump is logged and kept in
  ``skipped``.

What a replay cannot reproduce: decisions taken on the clock — groups released incomplete by the join
timeout whose missing messages arrived later, and gap jumps over prompts that arrived after the jump —
and, when the same rollout id was produced twice with different content (a rebalance redelivered a prompt
mid-generation), which copy the join kept. A run without those reproduces exactly; the run log tells
(``steps.jsonl`` carries ``skipped`` and the outcome counters carry ``dropped_timed_out``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from msgspec.structs import replace

from rlbus.schemas import Prompt, Rollout, decode
from rlbus.state.base import StateStore
from rlbus.training.join import FINAL, JoinBuffer, Outcome, RewardPolicy, ScoredGroup

log = logging.getLogger("rlbus.training.ordered")

#: The ``Prompt.metadata`` key holding the producer's sequence number.
SEQ = "seq"


def stamp(prompts: Iterable[Prompt], start: int = 0) -> Iterator[Prompt]:
    """Number ``prompts`` start, start + 1, … in ``metadata["seq"]`` (the producer admits them in order)."""
    for seq, prompt in enumerate(prompts, start):
        yield replace(prompt, metadata={**prompt.metadata, SEQ: str(seq)})


def prompt_seq(rollout: Rollout) -> int | None:
    """The sequence number of the rollout's prompt, None when it has none."""
    raw = rollout.prompt.metadata.get(SEQ) if rollout.prompt is not None else None
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


#: Completion times an ordered join keeps for the run log (a bound: a trainer without one never takes them).
COMPLETED_KEPT = 4096


class OrderedJoin(JoinBuffer):
    """A :class:`~rlbus.training.join.JoinBuffer` that releases complete groups in prompt order, ``batch``
    at a time, from :meth:`expire` (see the module docstring). :meth:`add_rollout` and
    :meth:`add_reward` buffer and always return None. It builds on the base class's store layout and
    hooks (``_group_key``, ``_complete``, ``_read``, ``_ready``, ``_close``), which exist for this subclass."""

    keeps_released = True  # a released group stays in the store until every rollout has an outcome

    def __init__(
        self,
        *,
        state: StateStore,
        policy: RewardPolicy,
        batch: int,
        gap_timeout_s: float | None = None,
        namespace: str = "join",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be ≥ 1")
        super().__init__(state=state, policy=policy, namespace=namespace, clock=clock)
        self.batch = batch
        self.gap_timeout_s = policy.timeout_s if gap_timeout_s is None else gap_timeout_s
        self.skipped: list[int] = []
        self._next: int | None = None
        self._seqs: dict[str, int] = {}
        self._held: dict[str, tuple[int | None, ScoredGroup]] = {}
        self._dropped: set[int] = set()
        self._released: dict[str, set[str]] = {}
        self._blocked_since: float | None = None
        #: When each group this process saw complete did so (by the join's clock), until the trainer's run log
        #: takes it (:class:`rlbus.launch.recording.TrainerRecorder`): completion → release → step is the
        #: in-order wait a replay reproduces, rollout → completion the pipeline's latency.
        self.completed_at: dict[str, float] = {}

    @property
    def complete_key(self) -> str:
        return f"{self._ns}:complete"

    @property
    def cursor_key(self) -> str:
        return f"{self._ns}:next_seq"

    # --- buffering -----------------------------------------------------------------------------------
    async def add_rollout(self, rollout: Rollout) -> ScoredGroup | None:
        seq = prompt_seq(rollout)
        if seq is not None:
            self._seqs[rollout.prompt_id] = seq
        return await super().add_rollout(rollout)

    async def _ready(self, prompt_id: str, meta: dict[str, float], count: int) -> ScoredGroup | None:
        if not await self._complete(prompt_id, meta, count):
            return None
        seq = self._seqs.get(prompt_id)
        if seq is None:  # only rewards arrived in this process: ask one buffered rollout
            seq = await self._stored_seq(prompt_id)
        self.completed_at[prompt_id] = self._clock()
        if len(self.completed_at) > COMPLETED_KEPT:  # nobody takes them (no run log): keep the newest only
            del self.completed_at[next(iter(self.completed_at))]
        # Kept, without expiry, until every rollout of it has an outcome.
        await self._state.put_field(self._group_key(prompt_id), "complete", b"1", None)
        await self._state.put_field(self.complete_key, prompt_id, b"" if seq is None else str(seq).encode(), None)
        await self._state.delete_field(f"{self._ns}:open", prompt_id)
        return None

    async def _stored_seq(self, prompt_id: str) -> int | None:
        """The sequence number of a group in the store, from one of its rollouts (one decoded, not G)."""
        key = self._group_key(prompt_id)
        names = sorted(n for n in await self._state.field_names(key) if n.startswith("r:"))
        if not names:
            return None
        raw = (await self._state.get_named(key, names[:1])).get(names[0])
        return None if raw is None else prompt_seq(decode(Rollout, raw))

    # --- releasing -----------------------------------------------------------------------------------
    async def cursor(self) -> int:
        """The next sequence number to release (read from the store once; a restarted trainer also learns
        the sequence numbers of the groups still open)."""
        if self._next is None:
            self._next = await self._state.get_counter(self.cursor_key)
            for prompt_id in await self._state.get_fields(f"{self._ns}:open"):
                if (seq := await self._stored_seq(prompt_id)) is not None:
                    self._seqs[prompt_id] = seq
        return self._next

    async def expire(self) -> list[ScoredGroup]:
        """Apply the join timeout, then release the next whole batches in prompt order."""
        await self.cursor()
        before = set(await self._state.get_fields(f"{self._ns}:open"))
        timed_out = await super().expire()
        after = await self._state.get_fields(f"{self._ns}:open")
        for expired in timed_out:
            seq = self._seqs.get(expired.prompt_id)
            if seq is None and expired.rollouts:
                seq = prompt_seq(expired.rollouts[0].rollout)
            self._held[expired.prompt_id] = (seq, expired)
        returned = {g.prompt_id for g in timed_out}
        for prompt_id in before - set(after) - returned:  # dropped whole by the timeout
            if prompt_id in self._seqs:
                self._dropped.add(self._seqs.pop(prompt_id))
        complete = await self._state.get_fields(self.complete_key)
        waiting: dict[str, int | None] = {
            pid: int(raw) if raw else None for pid, raw in complete.items() if pid not in self._released
        }
        waiting.update({pid: seq for pid, (seq, _) in self._held.items() if pid not in self._released})
        open_seqs = {self._seqs[pid] for pid in after if pid in self._seqs}
        released = []
        for prompt_id in await self._plan(waiting, open_seqs):
            group = await self._release(prompt_id)
            if group is not None:
                released.append(group)
        return released

    async def _plan(self, waiting: dict[str, int | None], open_seqs: set[int]) -> list[str]:
        """Which waiting groups go out now, in order; moves the cursor past what they cover."""
        jumped = False
        while True:
            cursor = await self.cursor()
            late = sorted((-1 if s is None else s, pid) for pid, s in waiting.items() if s is None or s < cursor)
            at: dict[int, list[str]] = {}
            for pid, s in waiting.items():
                if s is not None and s >= cursor:
                    at.setdefault(s, []).append(pid)
            run: list[tuple[int, str]] = []
            while True:
                while cursor in self._dropped:
                    cursor += 1
                if cursor not in at:
                    break
                run += [(cursor, pid) for pid in sorted(at[cursor])]
                cursor += 1
            ordered = [pid for _, pid in late] + [pid for _, pid in run]
            ahead = [s for s in (*at, *open_seqs) if s > cursor]
            if len(ordered) >= self.batch or not ahead or cursor in open_seqs:
                self._blocked_since = None
                break
            now = self._clock()
            self._blocked_since = self._blocked_since or now
            if jumped or now - self._blocked_since < self.gap_timeout_s:
                break
            target = min(ahead)  # nothing at all arrived for [cursor, target) while later groups wait
            log.warning("no message for prompt seq %d..%d after %.0f s; skipping to %d", cursor, target - 1,
                        now - self._blocked_since, target)
            self.skipped += range(cursor, target)
            await self.free_groups(target - cursor)  # those prompts will never hold a place in the order
            self._blocked_since = None
            await self._move(target)  # what the run had covered is now behind the cursor: released as late
            jumped = True
        take = ordered[: len(ordered) // self.batch * self.batch]
        taken = set(take)
        covered = [s for s, pid in run if pid in taken]
        if covered:
            end = max(covered) + 1
            while end in self._dropped:
                end += 1
            await self._move(end)
        elif not run:  # only groups dropped whole were passed
            await self._move(cursor)
        return take

    async def _move(self, new: int) -> None:
        old = await self.cursor()
        if new > old:
            await self._state.incr(self.cursor_key, new - old)
            self._dropped = {s for s in self._dropped if s >= new}
            self._next = new

    async def _release(self, prompt_id: str) -> ScoredGroup | None:
        held = self._held.get(prompt_id)
        if held is not None:
            group = held[1]
        else:
            group = await self._read(prompt_id)
        fresh = [s for s in group.rollouts if not await self._state.seen(FINAL, s.rollout.rollout_id)]
        if not fresh:  # everything in it already has an outcome (a restart after its step)
            await self._finish(prompt_id)
            return None
        self._released[prompt_id] = {s.rollout.rollout_id for s in fresh}
        return group if len(fresh) == len(group.rollouts) else ScoredGroup(prompt_id, fresh, group.unscored)

    async def record(self, outcome: Outcome, rollout_ids: Iterable[str]) -> int:
        ids = list(rollout_ids)
        counted = await super().record(outcome, ids)
        if self._released and ids:
            done = set(ids)
            for prompt_id, pending in list(self._released.items()):
                pending -= done
                if not pending:
                    await self._finish(prompt_id)
        return counted

    async def _finish(self, prompt_id: str) -> None:
        await self._close(prompt_id)
        await self._state.delete_field(self.complete_key, prompt_id)
        self._released.pop(prompt_id, None)
        self._held.pop(prompt_id, None)
        self._seqs.pop(prompt_id, None)

    def stats(self) -> dict[str, Any]:
        return {"next_seq": self._next, "released_untrained": len(self._released), "held": len(self._held),
                "skipped": len(self.skipped)}


async def buffered_rollouts(state: StateStore, namespace: str = "join") -> dict[str, list[str]]:
    """Rollout ids still in the join buffer, by prompt: open groups and complete ones not yet trained
    (for accounting what a stopped run left behind)."""
    prompts = set(await state.get_fields(f"{namespace}:open")) | set(await state.get_fields(f"{namespace}:complete"))
    out = {}
    for prompt_id in sorted(prompts):
        fields = await state.get_fields(f"{namespace}:group:{prompt_id}")
        ids = sorted(k[2:] for k in fields if k.startswith("r:"))
        if ids:
            out[prompt_id] = ids
    return out
