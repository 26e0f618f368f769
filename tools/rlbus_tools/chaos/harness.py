"""Running one in-process chaos scenario: fresh topics and state, the loop, the fault, the drain, the audit.

A scenario supplies a pipeline config and a *fault* coroutine, which waits for the right moment, breaks
something, repairs it and records what it did in the report. The harness watches the pipeline while
the fault runs (a worker that crashes ends the scenario as failed, with the error), waits until every
rollout has an outcome, stops the loop, and audits the ledger (:mod:`rlbus_tools.chaos.ledger`).

Recovery time is read from a progress log: the ledger's outcome count sampled every 100 ms.
``recovery_after(t)`` is the time from ``t`` to the first sample that counts more outcomes than the
count at ``t`` — how long the loop stalled after a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rlbus.blobs.base import BlobStore
from rlbus.errors import WorkerCrashed
from rlbus_tools.chaos.ledger import ScenarioReport, audit, fill
from rlbus_tools.chaos.pipeline import Pipeline, PipelineConfig
from rlbus_tools.chaos.rig import ChaosRig

log = logging.getLogger("rlbus_tools.chaos")


@dataclass
class Progress:
    """(monotonic time, outcomes so far) samples."""

    samples: list[tuple[float, int]] = field(default_factory=list)

    def count_at(self, t: float) -> int:
        before = [n for ts, n in self.samples if ts <= t]
        return before[-1] if before else 0

    def recovery_after(self, t: float) -> float | None:
        base = self.count_at(t)
        for ts, n in self.samples:
            if ts > t and n > base:
                return ts - t
        return None

    def longest_stall(self, t0: float, t1: float) -> float:
        """The longest time within [t0, t1] during which the outcome count did not move."""
        moves = [ts for (_, before), (ts, n) in itertools.pairwise(self.samples) if t0 < ts <= t1 and n > before]
        return max(b - a for a, b in itertools.pairwise([t0, *moves, t1]))

    async def wait_recovery(self, t: float, timeout_s: float) -> float | None:
        """:meth:`recovery_after`, waiting up to ``timeout_s`` for the first progress to show."""
        deadline = time.monotonic() + timeout_s
        while self.recovery_after(t) is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polled samples
            await asyncio.sleep(0.1)
        return self.recovery_after(t)


@dataclass
class Run:
    """What a fault coroutine gets: the running pipeline, the report to fill, the progress log."""

    pipeline: Pipeline
    report: ScenarioReport
    progress: Progress
    rig: ChaosRig
    #: Rollout ids the fault injected on the log (they must reach an outcome too).
    injected: list[str] = field(default_factory=list)
    #: Outcomes the fault's injections will add to the ledger beyond the pipeline's own rollouts.
    extra_outcomes: int = 0

    async def wait_outcomes(self, fraction: float, timeout_s: float = 120.0) -> int:
        """Wait until ``fraction`` of the pipeline's rollouts have an outcome; returns the count."""
        target = int(self.pipeline.expected * fraction)
        if not await self.pipeline.wait_outcomes(target, timeout_s):
            raise TimeoutError(f"fewer than {target} outcomes after {timeout_s:.0f} s")
        return await self.pipeline.outcomes()


Fault = Callable[[Run], Awaitable[None]]


async def _watched(aw: Awaitable[object], pipeline_task: asyncio.Task[None]) -> None:
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task, pipeline_task}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        error = pipeline_task.exception() if not pipeline_task.cancelled() else None
        raise WorkerCrashed(_describe(error) if error else "the pipeline stopped early")
    task.result()


def _describe(error: BaseException) -> str:
    """``Type: message`` of the error, or of each error a TaskGroup's ExceptionGroup holds (the group's own
    text only says how many there were)."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in error.exceptions)
    return f"{type(error).__name__}: {error}"


async def _sample(pipeline: Pipeline, progress: Progress, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):  # the state store may be the thing that is down
            progress.samples.append((time.monotonic(), await pipeline.outcomes()))
        await asyncio.sleep(0.1)


async def run_scenario(
    rig: ChaosRig,
    name: str,
    *,
    config: PipelineConfig,
    fault: Fault,
    store: BlobStore | None = None,
    truth: dict[int, str] | None = None,
    drain_timeout_s: float = 180.0,
) -> ScenarioReport:
    """Run the loop on fresh topics under ``fault`` until every rollout has an outcome, then audit."""
    report = ScenarioReport(scenario=name)
    began = time.monotonic()
    run_id = f"{name}-{uuid.uuid4().hex[:6]}"
    progress = Progress()
    async with rig.bus(client_id=f"rlbus-chaos-{name}") as bus:
        await rig.fresh_topics(bus)
        state = rig.state(prefix=f"chaos:{run_id}:")
        try:
            pipeline = Pipeline(bus=bus, state=state, config=config, run_id=run_id, store=store)
            stop, sampling_stop = asyncio.Event(), asyncio.Event()
            pipeline_task = asyncio.create_task(pipeline.run(stop))
            sampler = asyncio.create_task(_sample(pipeline, progress, sampling_stop))
            run = Run(pipeline=pipeline, report=report, progress=progress, rig=rig)
            try:
                await _watched(fault(run), pipeline_task)
                target = pipeline.expected + run.extra_outcomes
                await _watched(pipeline.wait_outcomes(target, drain_timeout_s), pipeline_task)
                report.check("every rollout reached an outcome in time", await pipeline.outcomes() >= target)
                report.check("workers kept running", not pipeline_task.done())
            except WorkerCrashed as exc:
                report.check("workers kept running", False)
                report.notes.append(f"a worker crashed: {exc}")
            except Exception as exc:  # a scenario that breaks is a failed row, not a crashed suite
                report.check("the fault ran to its end", False)
                report.notes.append(f"{type(exc).__name__}: {str(exc)[:600]}")
            finally:
                stop.set()
                sampling_stop.set()
                await sampler
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(60):
                        await pipeline_task
            found = await audit(bus=bus, state=state, join=pipeline.join, run_id=run_id, injected=run.injected)
            fill(report, found, trained_twice_seen=pipeline.join.trained_twice)
            report.extra["steps"] = pipeline.trainer.step
            if truth is not None:  # weights flowed: compare every swap with the trainer's digest
                report.corrupt_applied = pipeline.corrupt_served(truth)
                report.extra["swaps_checked"] = len(pipeline.served)
                report.check("every swap was checked against a known version", len(pipeline.served) > 0)
        finally:
            await state.close()
    report.wall_s = round(time.monotonic() - began, 2)
    return report.finish()
