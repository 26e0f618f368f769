"""The prompt producer: a dataset (task generator or JSONL file) → ``rl.prompts.v1``, with admission control.

Asynchronous RL keeps generating while the trainer trains, so without a bound the rollout workers would
run arbitrarily far ahead and the trainer would see ever staler data. Admission control bounds it the
way AReaL does (Fu et al., 2025, "AReaL: a large-scale asynchronous RL system", §5): the producer admits
prompt number n only while ``n < (versions + max_staleness + 1) × groups_per_step`` — ``versions`` being
the versions published since this producer started, so a trainer resumed at version 57 or one that
published its initial weights as version 1 does not open the gate wider — at most
``max_staleness`` trainer versions' worth of prompts ahead of the trainer — and while fewer than
``max_in_flight`` groups are admitted but not yet finished. Nobody stops: generation continues on what is
admitted, and new prompts flow as the trainer publishes versions.

The trainer's progress is read from the state store (counters ``trainer:version`` and
``trainer:groups_done``), so producers in other processes or regions see the same bound.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from rlbus.bus.base import Bus
from rlbus.bus.topics import PROMPTS
from rlbus.observe.metrics import ADMISSION_WAITS
from rlbus.schemas import Prompt
from rlbus.state.base import StateStore

log = logging.getLogger("rlbus.producers.prompts")

VERSION_COUNTER = "trainer:version"
GROUPS_DONE_COUNTER = "trainer:groups_done"


@dataclass(frozen=True)
class Progress:
    version: int
    groups_done: int


@dataclass(frozen=True)
class Admission:
    """The staleness bound the producer enforces."""

    #: Trainer versions a prompt may wait before its group is trained.
    max_staleness: int = 2
    #: Groups the trainer consumes per version (its batch size in groups).
    groups_per_step: int = 4
    #: Cap on admitted-but-unfinished groups (None: only the staleness bound).
    max_in_flight: int | None = None

    def allows(self, admitted: int, progress: Progress, *, base_version: int = 0) -> bool:
        """``base_version``: the trainer's version when counting started (``admitted`` = 0)."""
        if admitted >= (progress.version - base_version + self.max_staleness + 1) * self.groups_per_step:
            return False
        return self.max_in_flight is None or admitted - progress.groups_done < self.max_in_flight


def progress_from_state(state: StateStore) -> Callable[[], Awaitable[Progress]]:
    async def read() -> Progress:
        return Progress(await state.get_counter(VERSION_COUNTER), await state.get_counter(GROUPS_DONE_COUNTER))

    return read


def task_prompts(env: str, *, seed: int, group_size: int, config: dict[str, Any] | None = None) -> Iterator[Prompt]:
    """An endless seeded stream from a built-in task, in batches of 256 (seed, seed+1, …)."""
    from rlbus.envs.tasks import generate_prompts

    for batch in itertools.count():
        for prompt in generate_prompts(env, seed=seed + batch, n=256, config=config):
            yield replace(prompt, group_size=group_size)


def file_prompts(path: Path, *, repeat: bool = True) -> Iterator[Prompt]:
    """Prompts from a JSONL file (format in :mod:`rlbus.envs.tasks.jsonl`), cycled when ``repeat``."""
    from rlbus.envs.tasks.jsonl import iter_prompts

    for epoch in itertools.count():
        for prompt in iter_prompts(path):
            yield replace(prompt, prompt_id=f"{prompt.prompt_id}-e{epoch}") if epoch else prompt
        if not repeat:
            return


class PromptProducer:
    """Publishes prompts as fast as admission allows; ``limit`` stops after that many."""

    def __init__(
        self,
        *,
        bus: Bus,
        prompts: Iterator[Prompt],
        admission: Admission,
        progress: Callable[[], Awaitable[Progress]],
        run_id: str | None = None,
        limit: int | None = None,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = bus
        self._prompts = prompts
        self.admission = admission
        self._progress = progress
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.limit = limit
        self._poll_s = poll_s
        self._clock = clock
        self.admitted = 0
        self.waits = 0
        self._base_version: int | None = None

    def stats(self) -> dict[str, Any]:
        """What the producer's heartbeat carries (``processed`` = prompts admitted)."""
        return {"topics": [PROMPTS.name], "processed": self.admitted, "admitted": self.admitted,
                "waits": self.waits, "run_id": self.run_id}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and (self.limit is None or self.admitted < self.limit):
            progress = await self._progress()
            if self._base_version is None:
                self._base_version = progress.version
            if not self.admission.allows(self.admitted, progress, base_version=self._base_version):
                self.waits += 1
                ADMISSION_WAITS.inc()
                try:
                    await asyncio.wait_for(stop.wait(), self._poll_s)
                except TimeoutError:
                    pass
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
            log.debug(
                "prompt %s → %s[%d]@%d", prompt.prompt_id, meta.topic, meta.partition, meta.offset,
                extra={"topic": meta.topic, "partition": meta.partition, "offset": meta.offset,
                       "prompt_id": prompt.prompt_id, "version": progress.version},
            )
