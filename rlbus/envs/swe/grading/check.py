"""``rlbus env check``: a task is usable only if its reference solution scores 1 and the unchanged
repository scores 0 — graded exactly as rollouts are (`rlbus.envs.swe.grading.grade`), with timings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rlbus.envs.swe.grading.grade import grade
from rlbus.envs.swe.task import RepoTask
from rlbus.errors import RlbusError


@dataclass
class CheckResult:
    task_id: str
    solution_reward: float
    unchanged_reward: float
    solution_s: float
    unchanged_s: float
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


async def check_task(task: RepoTask) -> CheckResult:
    try:
        t0 = time.perf_counter()
        solved = await grade(task, task.solution)
        t1 = time.perf_counter()
        unchanged = await grade(task, "")
        t2 = time.perf_counter()
    except RlbusError as exc:
        return CheckResult(task.task_id, 0.0, 0.0, 0.0, 0.0, problem=f"cannot grade: {exc}")
    problems = []
    if solved.value != 1.0:
        problems.append(f"solution scores {solved.value:g}: {solved.reason}")
    if unchanged.value != 0.0:
        problems.append(f"unchanged repo scores {unchanged.value:g}: {unchanged.reason}")
    if solved.dropped:
        problems.append(f"the solution touches protected files: {solved.dropped}")
    return CheckResult(task.task_id, solved.value, unchanged.value, round(t1 - t0, 3), round(t2 - t1, 3),
                       "; ".join(problems))  # fmt: skip


async def check_tasks(
    tasks: list[RepoTask], on_result: Callable[[CheckResult], None] | None = None
) -> list[CheckResult]:
    results = []
    for task in tasks:
        result = await check_task(task)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
