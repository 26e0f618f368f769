"""What ``rlbus env check`` and ``rlbus env trajectories`` do, kept out of the CLI module (thin entry points)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbus.envs.swe.grading.check import CheckResult, check_tasks
from rlbus.envs.swe.task import load_tasks
from rlbus.envs.swe.trajectories import ObservationCut, write_trajectories


def check(paths: list[Path], *, as_json: bool, log: Callable[[str], None]) -> tuple[list[CheckResult], int]:
    """Check every task under ``paths``; returns the results and the exit code (1 if any failed)."""
    tasks = load_tasks(paths)
    log(f"checking {len(tasks)} task(s)")

    def progress(r: CheckResult) -> None:
        mark = "ok " if r.ok else "FAIL"
        log(f"  {mark} {r.task_id}  solution {r.solution_reward:g} ({r.solution_s:.2f}s)  "
            f"unchanged {r.unchanged_reward:g} ({r.unchanged_s:.2f}s)  {r.problem}")  # fmt: skip

    results = asyncio.run(check_tasks(tasks, None if as_json else progress))
    if as_json:
        report = {"tasks": [r.to_dict() for r in results], "valid": sum(r.ok for r in results), "total": len(results)}
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return results, 0 if all(r.ok for r in results) else 1


def trajectories(
    paths: list[Path], out: Path, *, log: Callable[[str], None], cut: ObservationCut | None = None
) -> dict[str, Any]:
    tasks = load_tasks(paths)
    log(f"replaying {len(tasks)} reference solution(s) through the tools → {out}")
    if cut is not None:
        log(f"tool outputs cut to {cut.max_tokens} tokens, as the agent loop cuts them")
    failed: list[str] = []

    def progress(task_id: str, reward: float, reason: str) -> None:
        log(f"  {'ok ' if reward == 1.0 else 'FAIL'} {task_id}: {reason}")
        if reward != 1.0:
            failed.append(task_id)

    with out.open("w") as f:
        written = asyncio.run(write_trajectories(tasks, f, progress, cut=cut))
    return {"written": written, "failed": failed}
