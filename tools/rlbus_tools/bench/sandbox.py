"""``rlbus bench sandbox``: what a unit-test reward costs in the bubblewrap sandbox, and what the sandbox holds.

Two parts, because a sandbox is only worth its cost if it also contains what it is paid to contain:

* **throughput** — real ``python_fn`` episodes (generated prompts answered with the task's reference turns)
  scored through the task's own ``score``: one fresh sandbox per reward running the hidden-test harness,
  sequentially and 2 / 4 at a time (asyncio). Same-run baseline: the very same harness, solution and
  inputs run by a plain ``python3`` subprocess (the interpreter the sandbox uses) in a temporary directory,
  so the ratio between the two is the sandbox's overhead and nothing else.
* **escape suite** (`rlbus_tools.bench.escapes`, also run by the unit tests) — hostile answers run exactly as the
  reward runs an answer; each attempt is judged by what the sandbox reported and by checks on the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlbus.envs.base import env_for
from rlbus.envs.chat import Answer, parse_action
from rlbus.envs.episode import Episode
from rlbus.envs.tasks import generate_prompts
from rlbus.envs.tasks.python_fn import HARNESS, PythonFnTask, extract_code
from rlbus.observe.stats import percentile
from rlbus.sandbox import find_bwrap, find_python
from rlbus.schemas import Prompt
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, require, write_json
from rlbus_tools.bench.escapes import PLAIN_ENV, escape_suite

#: Concurrency levels of the throughput part (2 shared cores on the reference machine; 4 shows saturation).
CONCURRENCY = (1, 2, 4)
#: Each level alternates plain and sandboxed rounds, so a load change on a shared machine hits both alike.
ROUNDS = 3


# --- throughput -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One reference-answered ``python_fn`` episode and the same test program for the plain baseline."""

    task: PythonFnTask
    prompt: Prompt
    episode: Episode
    code: str
    inputs: list[list[Any]]
    expected: list[str] = field(repr=False)
    """Canonical JSON of each expected value."""


def _jobs(n: int, seed: int = 0) -> list[_Job]:
    """``n`` generated prompts (all problems of the bank) answered with the task's reference turns."""
    jobs = []
    for i, prompt in enumerate(generate_prompts("python_fn", seed=seed, n=n)):
        task = env_for(prompt)
        if not isinstance(task, PythonFnTask):
            raise TypeError(f"{prompt.env} built {type(task).__name__}, not PythonFnTask")
        action = parse_action(task.reference_turns(prompt)[-1])
        if not isinstance(action, Answer):
            raise ValueError(f"reference turn of {prompt.prompt_id} is not an answer: {action}")
        episode = Episode(episode_id=f"bench-sandbox-{i}", token_ids=[], loss_mask=[], logprobs=[],
                          token_versions=[], turns=[], finish_reason="stop", answer=action.text)  # fmt: skip
        tests = task.config.tests
        jobs.append(_Job(task, prompt, episode, extract_code(action.text), [t.args for t in tests],
                         [json.dumps(t.expected, sort_keys=True) for t in tests]))  # fmt: skip
    return jobs


async def _score_sandboxed(job: _Job) -> float:
    """One reward through the task's public ``score``; seconds. A reference that fails stops the benchmark."""
    start = time.perf_counter()
    reward = await job.task.score(job.episode, job.prompt)
    elapsed = time.perf_counter() - start
    if reward.value != 1.0:
        raise RuntimeError(f"reference of {job.prompt.prompt_id} scored {reward.value}: {reward.reason}")
    return elapsed


async def _plain(job: _Job, python: str) -> float:
    """The same harness, solution and inputs run by a plain subprocess in a temp dir; seconds."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-plain-") as tmp:
        world = Path(tmp)
        (world / "solution.py").write_text(job.code)
        (world / "inputs.json").write_text(json.dumps({"function": job.task.config.function, "inputs": job.inputs}))
        (world / "harness.py").write_text(HARNESS)
        proc = await asyncio.create_subprocess_exec(
            python, "-B", "harness.py", cwd=tmp, env=PLAIN_ENV,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        results = json.loads((world / "results.json").read_bytes()) if proc.returncode == 0 else None
    elapsed = time.perf_counter() - start
    got = [json.dumps(r.get("value"), sort_keys=True) for r in results] if isinstance(results, list) else None
    if got != job.expected:
        raise RuntimeError(f"plain run of {job.prompt.prompt_id} failed: {err.decode(errors='replace')[-300:]}")
    return elapsed


async def _round(
    jobs: list[_Job], concurrency: int, one: Callable[[_Job], Awaitable[float]]
) -> tuple[list[float], float]:
    """Latencies (s) of ``jobs`` run ``concurrency`` at a time, and the round's wall time (s)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(job: _Job) -> float:
        async with gate:
            return await one(job)

    start = time.perf_counter()
    latencies = await asyncio.gather(*(gated(job) for job in jobs))
    return list(latencies), time.perf_counter() - start


def _figures(latencies: list[float], wall_s: float) -> dict[str, float]:
    ms = [s * 1000 for s in latencies]
    return {
        "execs_per_s": len(ms) / wall_s,
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "executions": len(ms),
    }


async def throughput(n: int) -> dict[str, Any]:
    """Sandboxed vs plain executions of reference ``python_fn`` rewards at each level of `CONCURRENCY`."""
    python = find_python()
    jobs = _jobs(n)
    for job in jobs[:4]:  # warm-up: the sandbox probe, imports, page cache
        await _score_sandboxed(job)
        await _plain(job, python)
    levels = []
    for concurrency in CONCURRENCY:
        runs: dict[str, tuple[list[float], float]] = {"plain": ([], 0.0), "sandbox": ([], 0.0)}
        for r in range(ROUNDS):
            chunk = jobs[r::ROUNDS]
            for kind, one in (("plain", lambda job: _plain(job, python)), ("sandbox", _score_sandboxed)):
                latencies, wall = await _round(chunk, concurrency, one)
                runs[kind] = (runs[kind][0] + latencies, runs[kind][1] + wall)
        plain, boxed = _figures(*runs["plain"]), _figures(*runs["sandbox"])
        levels.append({
            "concurrency": concurrency,
            "sandbox": boxed,
            "plain": plain,
            "overhead_ratio": plain["execs_per_s"] / boxed["execs_per_s"],
            "p50_overhead_ms": boxed["p50_ms"] - plain["p50_ms"],
        })  # fmt: skip
    config = jobs[0].task.config
    return {
        "workload": f"python_fn reference answers, {config.num_tests} hidden tests each, task.score per exec",
        "problems": sorted({job.task.config.function for job in jobs}),
        "python": python,
        "limits": asdict(jobs[0].task.sandbox_limits()),
        "levels": levels,
    }


# --- entry point ----------------------------------------------------------------------------------------------


def _bwrap_version() -> str | None:
    try:
        done = subprocess.run([find_bwrap(), "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


async def _run(quick: bool) -> dict[str, Any]:
    start = time.monotonic()
    escapes = await escape_suite()
    suite_s = time.monotonic() - start
    tput = await throughput(30 if quick else 150)
    return {
        "escapes_tried": len(escapes),
        "escapes_contained": sum(e.contained for e in escapes),
        "escapes": [asdict(e) for e in escapes],
        "escape_suite_s": round(suite_s, 2),
        "throughput": tput,
        "runtime_s": round(time.monotonic() - start, 2),
    }


def run(quick: bool, json_path: Path | None) -> dict[str, Any]:
    """``rlbus bench sandbox``: escape suite (always in full), then throughput (fewer executions if quick)."""
    result = asyncio.run(_run(quick))
    # str(): meta()'s torch version is a str subclass msgspec refuses to encode.
    result["meta"] = {
        **{key: str(value) if isinstance(value, str) else value for key, value in meta().items()},
        "quick": quick,
        "bwrap": _bwrap_version(),
        "worker_uid": os.geteuid(),
        "sandbox_uids": "one per sandbox from 65000–65533" if os.geteuid() == 0 else "the worker's own",
    }
    rows: list[list[Any]] = []
    for level in result["throughput"]["levels"]:
        plain, boxed = level["plain"], level["sandbox"]
        concurrency, ratio = level["concurrency"], f"{level['overhead_ratio']:.2f}"
        rows.append(["plain python3", concurrency, plain["execs_per_s"], plain["p50_ms"], plain["p99_ms"], "1.00"])
        rows.append(["sandbox (bwrap)", concurrency, boxed["execs_per_s"], boxed["p50_ms"], boxed["p99_ms"], ratio])
    print_table("rlbus bench sandbox — python_fn unit-test reward, one fresh sandbox per exec",
                ["runner", "concurrency", "execs/s", "p50 ms", "p99 ms", "overhead ×"], rows)  # fmt: skip
    print_table(
        f"escape suite — {result['escapes_contained']}/{result['escapes_tried']} contained",
        ["escape", "contained", "status", "evidence"],
        [[e["name"], "yes" if e["contained"] else "NO", e["status"], e["summary"]] for e in result["escapes"]],
    )  # fmt: skip
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """The sandbox: the escape suite (every attempt must be contained) and execution throughput."""
    result = run(quick=quick, json_path=json_path)
    require(result["escapes_contained"] >= result["escapes_tried"], "an escape attempt was NOT contained")
