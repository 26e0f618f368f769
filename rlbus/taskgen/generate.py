"""Turn released libraries into validated bug-fixing tasks: the SWE-smith loop, sandboxed and seeded.

For each library (``NAME==VER``): fetch its sdist (`sdist`), run its suite once with the call profiler
(`probe`) to learn which tests exercise which function, then repeatedly pick a covered function, inject one
bug (`mutators`) and run the test files that exercise it. A mutant is kept when between 1 and
``max_failing`` previously passing tests now fail: those are FAIL_TO_PASS, and a seeded sample of the
still-passing tests of the same files is PASS_TO_PASS. A mutant that fails nothing, fails too much, breaks
collection or times out is rejected and counted. Every kept task is then validated the way the grader will
see it — base snapshot + bug.patch must fail every FAIL_TO_PASS test, + solution.patch must pass them all and
every PASS_TO_PASS test — and only then written (`taskdir`), with those timings in the manifest.

One ``random.Random`` per library, seeded from ``(seed, library)``, makes every choice, so one seed gives one
corpus; test runs are sequential by design (the suites are CPU-bound and the generator should not compete
with other work — run it under ``nice``).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.errors import GenerateError
from rlbus.taskgen import mutators, patches, sdist, statement, taskdir
from rlbus.taskgen.runner import RunReport, TestRunner

#: Node ids the task lists: plain path::name[params] with no spaces or shell metacharacters, so a
#: command line carries them safely however the grader quotes.
SAFE_NODEID = re.compile(r"^[A-Za-z0-9_./-]+\.py(::[A-Za-z0-9_]+)+(\[[A-Za-z0-9_.,+=-]*\])?$")
Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """What to generate and how strictly."""

    libraries: Sequence[str]
    """``NAME==VERSION`` specs, in the order their tasks are made."""
    tasks: int
    """Total tasks to make, split evenly; a library that runs out leaves its share to the next ones."""
    seed: int = 0
    out: Path = Path("swe_tasks")
    max_failing: int = 50
    """Reject mutants that break more tests than this (a bug that breaks everything teaches little)."""
    pass_to_pass: int = 25
    """PASS_TO_PASS tests sampled per task from the failing tests' files."""
    max_covering: int = 150
    """Skip functions more tests than this call (helpers everything uses); their mutants fail too much."""
    attempts_per_task: int = 8
    """Mutants tried per wanted task before a library gives up (bounds the time spent on a poor library)."""
    test_timeout_s: int = 120
    slow_broken_s: float = 20.0
    """Reject a bug whose failing tests take longer than this and 4× the fixed run (an infinite generator
    that runs into the memory limit, say): every unsuccessful episode would pay that time at grading."""
    cache: Path | None = None


@dataclass
class LibraryResult:
    library: str
    made: int = 0
    tried: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    baseline_tests: int = 0
    baseline_s: float = 0.0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


@dataclass
class _Candidate:
    file: str
    line: int
    qualname: str
    tests: list[str]


def _quiet(_message: str) -> None:
    return None


async def generate(options: GenerateOptions, progress: Progress = _quiet) -> list[LibraryResult]:
    """Generate ``options.tasks`` tasks into ``options.out``; a per-library account of what was tried."""
    if options.tasks < 1:
        raise GenerateError("tasks must be ≥ 1")
    if not options.libraries:
        raise GenerateError("name at least one library (NAME==VERSION)")
    specs = [sdist.parse_spec(spec) for spec in options.libraries]
    options.out.mkdir(parents=True, exist_ok=True)
    document = taskdir.read_manifest(options.out)
    document.pop("checks", None)  # checks of the corpus as it was; rerun `rlbus env check` on the new one
    results: list[LibraryResult] = []
    made = 0
    with TestRunner(timeout_s=options.test_timeout_s) as runner:
        for index, (name, version) in enumerate(specs):
            quota = -(-(options.tasks - made) // (len(specs) - index))
            dropped = taskdir.drop_library(options.out, document, name)
            if dropped:
                progress(f"{name}: removed {dropped} earlier tasks of this library")
            result = await _library(runner, name, version, quota, options, document, progress)
            results.append(result)
            made += result.made
            taskdir.write_manifest(options.out, document)
    return results


async def _library(
    runner: TestRunner,
    name: str,
    version: str,
    quota: int,
    options: GenerateOptions,
    document: dict[str, Any],
    progress: Progress,
) -> LibraryResult:
    result = LibraryResult(f"{name}=={version}")
    archive = sdist.fetch(f"{name}=={version}", cache=options.cache)
    with tempfile.TemporaryDirectory(prefix="rlbus-swegen-") as tmp:
        library = sdist.load(name, version, sdist.extract(archive, Path(tmp) / "sdist"))
        base = Path(tmp) / "base"
        for relative in library.files:
            (base / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library.root / relative, base / relative)
        progress(f"{library.key}: {len(library.source_files)} modules, {len(library.test_files)} test files; "
                 "running the suite once with the call profiler")  # fmt: skip
        baseline = await runner.run(base, src=library.src, trace="")
        if not baseline.usable:
            raise GenerateError(f"{library.key}: the unchanged suite did not run ({baseline.status}): "
                                f"{_collect_reason(baseline)}")  # fmt: skip
        passing = set(baseline.ids("passed"))
        result.baseline_tests, result.baseline_s = len(passing), baseline.wall_s
        failed = len(baseline.ids("failed")) + len(baseline.ids("error"))
        progress(f"{library.key}: {len(passing)} tests pass unchanged ({failed} fail, excluded) "
                 f"in {baseline.wall_s:.1f}s")  # fmt: skip
        archive_name = f"{library.key}.tar.gz"
        taskdir.write_base(base, library.files, options.out / taskdir.BASES / archive_name)
        rng = random.Random(f"{options.seed}/{library.key}")
        candidates = _candidates(baseline, passing, library, options.max_covering)
        rng.shuffle(candidates)
        progress(f"{library.key}: {len(candidates)} covered functions; want {quota} tasks")
        budget = quota * options.attempts_per_task
        for candidate in candidates:
            if result.made >= quota or result.tried >= budget:
                break
            task = await _attempt(runner, library, base, candidate, passing, rng, options, result, progress)
            if task is None:
                continue
            task.base = archive_name
            taskdir.write_task(options.out, task)
            document.setdefault("tasks", []).append(taskdir.manifest_entry(task))
            result.made += 1
            progress(f"[{library.name} {result.made}/{quota}] kept {task.id}: {len(task.fail_to_pass)} FAIL_TO_PASS, "
                     f"{len(task.pass_to_pass)} PASS_TO_PASS")  # fmt: skip
    if result.made < quota:
        progress(f"{library.key}: made {result.made} of {quota} after {result.tried} mutants")
    return result


def _collect_reason(report: RunReport) -> str:
    if report.collect_errors:
        return str(report.collect_errors[0].get("message", ""))[-400:]
    return report.stderr[-400:]


def _candidates(baseline: RunReport, passing: set[str], library: sdist.Library, max_covering: int) -> list[_Candidate]:
    sources = set(library.source_files)
    covering: dict[tuple[str, int, str], set[str]] = {}
    for nodeid, calls in baseline.calls.items():
        if nodeid not in passing:
            continue
        for file, line, qualname in calls:
            if file in sources and "<" not in qualname.rsplit(".", 1)[-1]:
                covering.setdefault((file, line, qualname), set()).add(nodeid)
    return [
        _Candidate(file, line, qualname, sorted(tests))
        for (file, line, qualname), tests in sorted(covering.items())
        if len(tests) <= max_covering
    ]


async def _attempt(
    runner: TestRunner,
    library: sdist.Library,
    base: Path,
    candidate: _Candidate,
    passing: set[str],
    rng: random.Random,
    options: GenerateOptions,
    result: LibraryResult,
    progress: Progress,
) -> taskdir.GeneratedTask | None:
    source = (base / candidate.file).read_text(encoding="utf-8")
    function = mutators.find_function(ast.parse(source), candidate.line, candidate.qualname.rsplit(".", 1)[-1])
    if function is None:
        return None
    mutation = mutators.choose(source, function, rng, tried=set())
    if mutation is None:
        return None
    result.tried += 1
    label = f"{candidate.file}:{candidate.qualname} {mutation.kind}"
    mutated = mutation.apply(source)
    files = sorted({nodeid.split("::", 1)[0] for nodeid in candidate.tests})
    report = await runner.run(base, files, src=library.src, overrides={candidate.file: mutated})
    if report.status == "timeout":
        return _rejected(result, "timeout", label, progress)
    if not report.usable:
        return _rejected(result, "breaks collection", label, progress)
    broken = sorted(n for n in passing if n in report.tests and report.tests[n].outcome in ("failed", "error"))
    if not broken:
        return _rejected(result, "fails nothing", label, progress)
    if len(broken) > options.max_failing:
        return _rejected(result, f"fails > {options.max_failing}", label, progress)
    fail_to_pass = [n for n in broken if SAFE_NODEID.match(n)]
    if not fail_to_pass:
        return _rejected(result, "no plain node ids", label, progress)
    failing_files = {n.split("::", 1)[0] for n in fail_to_pass}
    still = sorted(
        n for n, t in report.tests.items()
        if t.outcome == "passed" and n in passing and n.split("::", 1)[0] in failing_files and SAFE_NODEID.match(n)
    )  # fmt: skip
    pass_to_pass = sorted(rng.sample(still, min(len(still), options.pass_to_pass)))
    task = _task(library, base, candidate, mutation, source, mutated, fail_to_pass, pass_to_pass, report, options)
    checked = await _validate(runner, library, base, task)
    if checked is None:
        return _rejected(result, "unstable under validation", label, progress)
    if checked["unchanged_s"] > max(options.slow_broken_s, 4 * checked["solution_s"]):
        return _rejected(result, "slow when broken", label, progress)
    task.checked = checked
    return task


def _rejected(result: LibraryResult, reason: str, label: str, progress: Progress) -> taskdir.GeneratedTask | None:
    result.reject(reason)
    progress(f"  rejected {label}: {reason}")
    return None


def _task(
    library: sdist.Library,
    base: Path,
    candidate: _Candidate,
    mutation: mutators.Mutation,
    source: str,
    mutated: str,
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    report: RunReport,
    options: GenerateOptions,
) -> taskdir.GeneratedTask:
    bug = patches.diff(candidate.file, source, mutated)
    digest = hashlib.sha256(bug.encode()).hexdigest()[:6]
    names = [part.strip("_").lower() for part in candidate.qualname.split(".") if part != "<locals>"]
    function = "-".join(dict.fromkeys(n for n in (names[0], names[-1]) if n)) or "fn"
    task_id = f"{library.name}-{function}-{mutation.kind}-{digest}".replace("_", "-")
    hidden_lines = [source.splitlines()[mutation.line - 1], *mutated.splitlines()[mutation.line - 1 : mutation.line]]
    first = report.tests[fail_to_pass[0]].error
    chain = statement.call_chain(first, package_files=library.source_files)
    instruction = statement.write(
        library=library.name,
        version=library.version,
        failing=fail_to_pass,
        first_error=first,
        chain=chain,
        hidden=hidden_lines,
        command=f"PYTHONPATH={library.src} {taskdir.DEFAULT_COMMAND}" if library.src else taskdir.DEFAULT_COMMAND,
    )
    hidden: dict[str, bytes] = {}
    for relative in sorted({n.split("::", 1)[0] for n in fail_to_pass + pass_to_pass}):
        hidden[relative] = (base / relative).read_bytes()
        parts = relative.split("/")
        for depth in range(len(parts)):
            conftest = "/".join([*parts[:depth], "conftest.py"])
            if (base / conftest).is_file():
                hidden[conftest] = (base / conftest).read_bytes()
    module = candidate.file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return taskdir.GeneratedTask(
        id=task_id,
        library=library.name,
        version=library.version,
        base="",
        instruction=instruction,
        bug_patch=bug,
        solution_patch=patches.diff(candidate.file, mutated, source),
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        hidden_tests=hidden,
        src=library.src,
        metadata={
            "library": library.name,
            "version": library.version,
            "module": module.removeprefix("src."),
            "function": candidate.qualname,
            "bug_kind": mutation.kind,
            "generator": "rlbus.taskgen",
            "seed": options.seed,
        },
        test_timeout_s=options.test_timeout_s,
    )


async def _validate(
    runner: TestRunner, library: sdist.Library, base: Path, task: taskdir.GeneratedTask
) -> dict[str, Any] | None:
    """Base + bug.patch fails every FAIL_TO_PASS; + solution.patch passes all; None if either does not hold."""
    tests = task.fail_to_pass + task.pass_to_pass
    with tempfile.TemporaryDirectory(prefix="rlbus-swegen-check-") as tmp:
        repo = Path(tmp) / "repo"
        shutil.copytree(base, repo)
        patches.apply(repo, task.bug_patch)
        unchanged = await runner.run(repo, tests, src=library.src)
        patches.apply(repo, task.solution_patch)
        solved = await runner.run(repo, tests, src=library.src)
    if not (unchanged.usable and solved.usable):
        return None
    if any(n not in unchanged.tests or unchanged.tests[n].outcome == "passed" for n in task.fail_to_pass):
        return None
    if any(n not in solved.tests or solved.tests[n].outcome != "passed" for n in tests):
        return None
    return {
        "solution_reward": 1.0,
        "unchanged_reward": 0.0,
        "solution_s": solved.wall_s,
        "unchanged_s": unchanged.wall_s,
        "by": "generator: rlbus.sandbox (bwrap), patch -p1, /usr/bin/python3 + pytest/hypothesis on PYTHONPATH",
    }
