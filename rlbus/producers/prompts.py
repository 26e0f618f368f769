"""The prompt producer: a dataset (task generator or JSONL file) → ``rl.prompts.v1``, with admission control.

Asynchronous RL keeps generating while the trainer trains, so without a bound the rollout workers would
run arbitrarily far ahead and the trainer would see ever staler data. Admission control bounds it the
way AReaL does (Fu et al., 2025, "AReaL: a large-scale asynchronous RL system", §5): the producer admits
its n-th prompt (from 0) only while

    n < (reference − base + max_staleness − slack + 1) × groups_per_version

and while fewer than ``max_in_flight`` groups are admitted but not yet finished. Nobody stops: generation
continues on what is admitted, and new prompts flow as versions arrive. Why exactly this bound:

* The trainer takes groups in prompt order (:mod:`rlbus.training.ordered`), ``groups_per_version`` of
  them per version (groups per step × steps per version), so prompt n is trained at version
  ``t(n) = base + n // groups_per_version``. ``base`` is the version the trainer trains this producer's
  first prompt at: its version when the producer started (a trainer resumed at version 57 does not open
  the gate 57 versions wide), but at least ``first_version`` — the distributed trainer publishes its
  initial weights as v1 *before* its first step, and a producer that starts before that publish and
  counts from 0 admits a version's worth of prompts too many, each trained ``max_staleness`` + 1
  versions after the v1 it was generated with, and dropped (``rlbus up`` starts every role at once).
* The trainer drops a rollout whose oldest token is more than ``max_staleness`` versions older than
  ``t(n)``. The oldest token comes from the weights the worker held when it *started* the prompt, which
  are at least the version every live rollout worker held when the prompt was admitted: workers only
  move forward. So the bound counts from the version the rollout fleet **serves**, not the one the
  trainer **published**: ``reference = min(published, lowest version a live rollout worker serves)``.
  AReaL may count from the trainer's version because there the weight update has reached the inference
  servers before the version counts; here workers stage each delta while they generate (download,
  decode, digest check: seconds on a CPU, more for a large model in a far region). Counting from the
  published version lets them start prompts on weights up to three versions older than the bound
  assumes: in a short distributed run 15–25 % of the rollouts are then dropped as stale (the first delta
  takes 2.5–3.4 s to stage on 2 busy cores while the trainer, catching up on waiting groups, publishes
  three versions in about 1.5 s).
* ``slack`` budgets versions of lag the reference cannot see: with ``served`` unknown (no worker reports
  a version, or the run counts from the published version on purpose) it is the expected weight-sync lag
  in versions. It stays within ``max_staleness``, or nothing would ever be admitted.

Groups that end untrained. ``t(n)`` above assumes every group before prompt n moves the trainer a
``1 / groups_per_version`` of a version. A group that ends without doing so — all of its rollouts dropped as
stale in a step that therefore trained nothing, dropped whole at the join (incomplete at its timeout,
its rollouts dead-lettered), or skipped as a gap in prompt order — does not, so the version that prompt n
is trained at is ``base + (n − freed) // groups_per_version``, where ``freed`` counts those groups (state
counter ``trainer:groups_freed``, kept by the trainer). Admission adds ``freed`` to the window: a group
that ended untrained frees its slot. Without that credit the window counted them as if they had advanced
the trainer: after ``(max_staleness − slack + 1) × groups_per_version`` such groups no prompt was ever
admitted again, the trainer never stepped again, and the run was dead — a first run whose codec kernels
were still compiling lost its first versions' rollouts to staleness and then stalled for good. The credit
keeps the bound: freed groups only move later prompts *earlier* in the trainer's order.

Under the bound an admitted prompt's rollouts are within ``max_staleness`` when trained — unless the
trainer's order or pace differs from the above (the plain join releases groups as they complete), which
the trainer's own check still catches: its ``max_staleness`` is the hard bound. The fleet's lag costs
admission — prompts wait in the producer, mostly while the workers are busy with earlier ones, otherwise
for as long as a swap takes — instead of generation that is thrown away. A worker that stays behind (its
blob store unreachable) holds admission back until it catches up or leaves the registry (five heartbeats
after its last).

The trainer's progress is read from the state store (counters ``trainer:version``,
``trainer:groups_done`` and ``trainer:groups_freed``) and the versions the rollout workers serve from
the worker registry (each rollout worker's heartbeat carries its ``version``, and it beats as soon as it
swaps a new one in), so producers in other processes or regions see the same bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from rlbus.aio import wait_event
from rlbus.bus.base import Bus
from rlbus.bus.topics import PROMPTS
from rlbus.metrics import ADMISSION_WAITS
from rlbus.schemas import Prompt
from rlbus.state.base import StateStore, WorkerRecord
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER, VERSION_COUNTER

log = logging.getLogger("rlbus.producers.prompts")

@dataclass(frozen=True)
class Progress:
    """What admission reads: the trainer's newest published version, the groups it has finished, the
    lowest version the live rollout workers serve (None: unknown, so the published version counts) and the
    groups that ended without moving the trainer towards a version (each frees its slot)."""

    version: int
    groups_done: int
    served: int | None = None
    groups_freed: int = 0


@dataclass(frozen=True)
class Admission:
    """The staleness bound the producer enforces (the module docstring derives it)."""

    #: Trainer versions a prompt may wait before its group is trained (the trainer's max_staleness).
    max_staleness: int = 2
    #: Groups the trainer consumes per version: groups per step × steps per published version.
    groups_per_step: int = 4
    #: Cap on admitted-but-unfinished groups (None: only the staleness bound).
    max_in_flight: int | None = None
    #: Versions of weight-sync lag budgeted beyond what ``Progress.served`` shows (0..max_staleness).
    slack: int = 0

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.max_staleness < 0:
            raise ValueError("groups_per_step must be >= 1 and max_staleness >= 0")
        if not 0 <= self.slack <= self.max_staleness:
            raise ValueError(f"slack must be in 0..max_staleness ({self.max_staleness}), got {self.slack}")

    @staticmethod
    def reference(progress: Progress) -> int:
        """The version every prompt admitted now will be started with, at the least."""
        return progress.version if progress.served is None else min(progress.version, progress.served)

    def window(self, progress: Progress, *, base_version: int = 0) -> int:
        """How many prompts may be admitted in all, counting from ``base_version`` (``admitted`` = 0), plus
        one for each group that ended untrained (``groups_freed``, counted since the producer started)."""
        ahead = self.reference(progress) - base_version + self.max_staleness - self.slack + 1
        return max(0, ahead * self.groups_per_step) + progress.groups_freed

    def allows(self, admitted: int, progress: Progress, *, base_version: int = 0) -> bool:
        """``base_version``: the version the trainer trains the first admitted prompt at."""
        if admitted >= self.window(progress, base_version=base_version):
            return False
        return self.max_in_flight is None or admitted - progress.groups_done < self.max_in_flight


def lowest_served(workers: Iterable[WorkerRecord]) -> int | None:
    """The lowest ``version`` among registry entries still running (a stopping worker takes no new
    prompts; one still loading its first version reports none and joins at the newest)."""
    versions = [
        version for w in workers
        if w["info"].get("status") != "stopping"
        and isinstance(version := w["info"].get("version"), int) and not isinstance(version, bool)
    ]
    return min(versions, default=None)


def progress_from_state(state: StateStore, *, served_by: str | None = None) -> Callable[[], Awaitable[Progress]]:
    """Progress from the state store; ``served_by`` names the registry role whose live workers' versions
    bound admission (``"rollout"``), None leaves ``served`` unknown."""

    async def read() -> Progress:
        served = None if served_by is None else lowest_served(await state.workers(served_by))
        return Progress(await state.get_counter(VERSION_COUNTER), await state.get_counter(GROUPS_DONE_COUNTER),
                        served, await state.get_counter(GROUPS_FREED_COUNTER))

    return read


def task_prompts(env: str, *, seed: int, group_size: int, config: dict[str, Any] | None = None) -> Iterator[Prompt]:
    """An endless seeded stream from a built-in task, in batches of 256 (seed, seed+1, …)."""
    from rlbus.envs.tasks import generate_prompts

    for batch in itertools.count():
        for prompt in generate_prompts(env, seed=seed + batch, n=256, config=config):
            yield replace(prompt, group_size=group_size)


def file_prompts(path: str | Path, *, repeat: bool = True, group_size: int | None = None) -> Iterator[Prompt]:
    """Prompts from a JSONL file (format in :mod:`rlbus.envs.tasks.jsonl`) in the file's order, cycled when
    ``repeat`` (epoch k > 0 suffixes each prompt id with ``-e<k>``); ``group_size`` is that of lines giving
    none (None: the format's default). A file without prompts ends the stream instead of cycling forever."""
    from rlbus.envs.tasks.jsonl import DEFAULT_GROUP_SIZE, iter_prompts

    for epoch in itertools.count():
        empty = True
        for prompt in iter_prompts(path, group_size=group_size or DEFAULT_GROUP_SIZE):
            empty = False
            yield replace(prompt, prompt_id=f"{prompt.prompt_id}-e{epoch}") if epoch else prompt
        if empty or not repeat:
            return


class PromptProducer:
    """Publishes prompts as fast as admission allows; ``limit`` stops after that many.

    ``first_version``: the lowest version the trainer can train this producer's first prompt at — the
    distributed trainer publishes its initial weights as v1 before training, so a producer that starts
    before that publish counts from 1, not from the 0 it reads (see the module docstring).
    """

    def __init__(
        self,
        *,
        bus: Bus,
        prompts: Iterator[Prompt],
        admission: Admission,
        progress: Callable[[], Awaitable[Progress]],
        run_id: str | None = None,
        limit: int | None = None,
        first_version: int = 0,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = bus
        self._prompts = prompts
        self.admission = admission
        self._progress = progress
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.limit = limit
        self.first_version = first_version
        self._poll_s = poll_s
        self._clock = clock
        self.admitted = 0
        #: Called with each prompt once it is on the bus (the run log's ``prompts`` line).
        self.on_admit: Callable[[Prompt], None] | None = None
        self.waits = 0
        #: Waits the published version alone would have allowed: rollout workers still syncing held them.
        self.sync_waits = 0
        self.reference: int | None = None
        self._base_version: int | None = None
        #: ``trainer:groups_freed`` when the producer started: groups freed before it admitted anything
        #: are not its prompts' credit (a restarted producer must not open the window by the run's past).
        self._base_freed: int | None = None
        #: Groups freed since the producer started (slots the window regained).
        self.freed = 0

    def stats(self) -> dict[str, Any]:
        """What the producer's heartbeat carries (``processed`` = prompts admitted)."""
        return {"topics": [PROMPTS.name], "processed": self.admitted, "admitted": self.admitted,
                "waits": self.waits, "sync_waits": self.sync_waits, "reference_version": self.reference,
                "base_version": self._base_version, "freed": self.freed, "run_id": self.run_id}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and (self.limit is None or self.admitted < self.limit):
            progress = await self._progress()
            if self._base_version is None or self._base_freed is None:
                self._base_version = max(progress.version, self.first_version)
                self._base_freed = progress.groups_freed
            self.freed = progress.groups_freed - self._base_freed
            progress = dataclasses.replace(progress, groups_freed=self.freed)
            self.reference = self.admission.reference(progress)
            if not self.admission.allows(self.admitted, progress, base_version=self._base_version):
                self.waits += 1
                if progress.served is not None and self.admission.allows(
                    self.admitted, dataclasses.replace(progress, served=None), base_version=self._base_version
                ):
                    self.sync_waits += 1
                ADMISSION_WAITS.inc()
                await wait_event(stop, self._poll_s)
                continue
            prompt = next(self._prompts, None)
            if prompt is None:
                log.info("prompt source exhausted after %d prompts", self.admitted)
                return
            prompt = replace(
                prompt,
                prompt_id=f"{self.run_id}-{self.admitted:08d}-{prompt.prompt_id}",
                policy_version=progress.version,
                created_at=self._clock(),
            )
            meta = await self._bus.send(PROMPTS, prompt)
            self.admitted += 1
            if self.on_admit is not None:
                self.on_admit(prompt)
            log.debug(
                "prompt %s → %s[%d]@%d", prompt.prompt_id, meta.topic, meta.partition, meta.offset,
                extra={"topic": meta.topic, "partition": meta.partition, "offset": meta.offset,
                       "prompt_id": prompt.prompt_id, "version": progress.version},
            )
