"""Hidden-test grading of a patch: fresh copy, filtered patch, split tests, pytest under a launcher.

`grade` is the reward of the coding environment (and of `rlbus env check`):

1. the patch goes through `rlbus.envs.swe.patch.filter_patch`: sections outside the repository,
   symlinks, binaries, renames, and every file that decides how tests are *run* (tests, conftest, pytest
   / tox / setup.cfg / pyproject configuration, sitecustomize / usercustomize / ``.pth``, anything named
   like a runner module) are dropped and listed;
2. a fresh copy of the task's template is made in a new sandbox, the rest is ``git apply``-ed *inside*
   the sandbox (a patch that does not apply scores 0 with git's reason), the hidden test files are
   written over it and the task's ``test_patch`` applied;
3. the trusted test files (the hidden tests, the test patch's files, the template's test files and
   conftest) are read back and split here, on the worker (`rlbus.envs.swe.grading.split`): each assertion reports
   its computed operands, the expected ones stay out. The visible code is written over the tests, which
   are mounted read-only for the run;
4. the task's pytest command runs under the launcher `rlbus.envs.swe.grading.grader_main` (mounted in grading
   sandboxes only: an episode never sees it), which gets a one-time key and the split on stdin, never
   imports the repository, and compares every assertion with the answers only it holds; its child
   `rlbus.envs.swe.grading.grader_runner` imports the repository and reports over a kernel-guarded socket. The
   launcher writes an HMAC-signed report outside the repository;
5. the report must verify, show no tampering (refused introspection, forged or missing records, a second
   writer, an assertion the grader cannot read, a test function that never ran or returned without its
   assertions), have collected exactly the expected node ids (or their parametrisations), and agree with
   pytest's exit code. Reward 1 only when every FAIL_TO_PASS and every PASS_TO_PASS test passed (setup,
   call and teardown); components are the fractions of each that passed.

docs/architecture.md ("The grader's trust boundary") states what is defended and what is not; the hack
monitor (`rlbus.envs.swe.grading.monitor`) reads the patch, and `[reward] hack_policy` decides what its findings cost.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shlex
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.envs.swe.grading.monitor import Finding, added_lines, hack_kinds, scan_source
from rlbus.envs.swe.grading.split import Split, split_tests
from rlbus.envs.swe.patch import filter_patch, protected_kind
from rlbus.envs.swe.runtime import GRADER_INNER, HYPOTHESIS_PLUGIN, INNER
from rlbus.envs.swe.task import RepoTask
from rlbus.envs.swe.world import REPO, task_sandbox, template
from rlbus.sandbox import Sandbox, SandboxResult
from rlbus.schemas.reward import HACK_KINDS, TAMPERED

_REPORT = "grade/report.json"
_GIT_ENV = {"GIT_CEILING_DIRECTORIES": "/sandbox", "HOME": "/sandbox/grade", "GIT_CONFIG_NOSYSTEM": "1"}


@dataclass
class Verdict:
    """The outcome of grading one patch."""

    value: float
    reason: str
    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    pass_to_pass: dict[str, bool] = field(default_factory=dict)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    tampered: list[str] = field(default_factory=list)
    hacks: list[Finding] = field(default_factory=list)
    """The hack monitor's findings on the library code the patch adds (`rlbus.envs.swe.grading.monitor`)."""
    assertions: list[str] = field(default_factory=list)
    """The launcher's reasons for the tests whose assertions did not hold (``node: why``)."""
    wall_s: float = 0.0
    status: str = ""
    """The sandbox status of the test run (``ok``, ``error`` when tests failed, ``timeout`` …)."""

    @property
    def failing(self) -> list[str]:
        return [n for n, ok in {**self.fail_to_pass, **self.pass_to_pass}.items() if not ok]

    def components(self) -> dict[str, float]:
        def frac(d: dict[str, bool]) -> float:
            return sum(d.values()) / len(d) if d else 1.0

        return {
            "fail_to_pass": frac(self.fail_to_pass) if self.fail_to_pass else 0.0,
            "pass_to_pass": frac(self.pass_to_pass),
            "dropped_files": float(len(self.dropped)),
        }

    def metadata(self) -> dict[str, str]:
        data = {"failing": ",".join(self.failing)[:4000], "status": self.status, "tests_wall_s": f"{self.wall_s:.3f}"}
        if self.assertions:
            data["assertions"] = "; ".join(self.assertions)[:4000]
        if self.dropped:
            data["dropped"] = "; ".join(f"{p} ({why})" for p, why in self.dropped)[:4000]
        if self.tampered:
            data[TAMPERED] = "; ".join(self.tampered)[:4000]
        if self.hacks:
            data[HACK_KINDS] = ",".join(hack_kinds(self.hacks))
            data["hacks"] = "; ".join(str(f) for f in self.hacks)[:4000]
        return data


async def grade(task: RepoTask, patch: str) -> Verdict:
    """Grade ``patch`` (a git-format diff against the task's starting repository); see the module docstring.

    Raises SandboxError only when the sandbox cannot be built (the worker's failure, not the patch's)."""
    filtered = filter_patch(patch, protected=task.test_paths())
    base = await template(task)
    async with task_sandbox(task, grading=True) as box:
        await box.populate(base, REPO)
        hacks: list[Finding] = []
        if filtered.patch:
            applied = await _git_apply(box, filtered.patch, "agent.patch")
            if not applied.ok:
                return _zero(f"the patch does not apply: {applied.stderr.strip()[-300:]}", filtered.dropped)
            hacks = scan_patch(box, filtered.patch)
        for path, content in task.hidden_tests.items():
            box.write(f"{REPO}/{path}", content)
        if task.test_patch:
            applied = await _git_apply(box, task.test_patch, "test.patch")
            if not applied.ok:
                return _zero(f"the task's test_patch does not apply: {applied.stderr.strip()[-300:]}", filtered.dropped)
        try:
            split = split_trusted(box, trusted_files(task, base), task.tests)
        except ValueError as exc:  # a grader bug: never a pass
            return _zero(f"the grader could not split the hidden tests: {exc}", filtered.dropped)
        key = secrets.token_bytes(32)
        plan = {"files": split.visible, "slots": {n: s.to_dict() for n, s in split.slots.items()}}
        run = await box.run(launcher_argv(task, split.renamed), stdin=key + json.dumps(plan).encode(), cwd=REPO,
                            readonly=[f"{REPO}/{p}" for p in readonly_paths(split.visible)])  # fmt: skip
        report = box.read(_REPORT)
    verdict = judge(task, run, report, key, renamed=split.renamed)
    verdict.dropped, verdict.hacks = filtered.dropped, hacks
    return verdict


def scan_patch(box: Sandbox, patch: str) -> list[Finding]:
    """The hack monitor on the applied patch: each Python file it adds lines to, read back from the sandbox
    (the tests are already filtered out of ``patch``), scanned on those lines."""
    found: list[Finding] = []
    for path, lines in added_lines(patch).items():
        if not path.endswith(".py"):
            continue
        raw = box.read(f"{REPO}/{path}")
        if raw is not None:
            found += scan_source(path, raw.decode(errors="replace"), lines)
    return found


def trusted_files(task: RepoTask, base: Path) -> list[str]:
    """The repository files the grader vouches for (their frames are not the code under test's): the
    hidden tests, the files of the task's test patch, and the template's Python files that the patch filter
    protects (tests, test directories, conftest): no patch reaches them."""
    files = {*task.hidden_tests, *task.test_paths()}
    files.update(rel for p in base.rglob("*.py") if protected_kind(rel := str(p.relative_to(base))) is not None)
    return sorted(f for f in files if f.endswith(".py") and ":" not in f)


def split_trusted(box: Sandbox, paths: list[str], tests: tuple[str, ...]) -> Split:
    """The trusted files as they are in the sandbox now (before any code of the repository has run), split
    (`rlbus.envs.swe.grading.split`); the visible code written over them."""
    sources = {p: raw for p in paths if (raw := box.read(f"{REPO}/{p}")) is not None}
    split = _split_cached(sources, tests)
    for path, text in split.visible.items():
        box.write(f"{REPO}/{path}", text)
    return split


_SPLITS: OrderedDict[str, Split] = OrderedDict()


def _split_cached(sources: dict[str, bytes], tests: tuple[str, ...]) -> Split:
    """`split_tests`, remembered for the last 64 sets of files (a task is graded many times)."""
    digest = hashlib.sha256("\n".join(tests).encode())
    for path in sorted(sources):
        digest.update(hashlib.sha256(path.encode()).digest() + hashlib.sha256(sources[path]).digest())
    key = digest.hexdigest()
    if key in _SPLITS:
        _SPLITS.move_to_end(key)
        return _SPLITS[key]
    split = _SPLITS[key] = split_tests(sources, tests)
    while len(_SPLITS) > 64:
        _SPLITS.popitem(last=False)
    return split


def readonly_paths(files: dict[str, str]) -> list[str]:
    """What the test run may not write: each trusted file's directory (the file itself at the root)."""
    dirs = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})
    tops = [d for d in dirs if not any(d.startswith(o + "/") for o in dirs)]
    return tops + sorted(p for p in files if "/" not in p)


def launcher_argv(task: RepoTask, renamed: dict[str, str] | None = None) -> list[str]:
    """The launcher's command line; ``renamed``: node ids whose case the split renamed (no answer in them)."""
    words = shlex.split(task.command)
    args: list[str] = ["-p", HYPOTHESIS_PLUGIN]
    tests = [(renamed or {}).get(t, t) for t in task.tests]
    for word in words[3:]:  # after "python -m pytest"
        args += tests if word == "{tests}" else [word]
    extra = ":".join(p for p in task.test_env.get("PYTHONPATH", "").split(":") if p)
    grader = f"{GRADER_INNER}/grader_main.py"
    return [f"{INNER}/bin/python", "-I", "-B", grader, INNER, f"/sandbox/{_REPORT}", f"/sandbox/{REPO}", extra,
            "--", *args]


async def _git_apply(box: Sandbox, patch: str, name: str) -> SandboxResult:
    box.write(f"grade/{name}", patch)
    argv = ["git", "apply", "--whitespace=nowarn", f"/sandbox/grade/{name}"]
    return await box.run(argv, cwd=REPO, env=_GIT_ENV)


def judge(
    task: RepoTask, run: SandboxResult, raw: bytes | None, key: bytes, renamed: dict[str, str] | None = None
) -> Verdict:
    """The verdict from the launcher's report; any doubt about the report is a 0. ``renamed``: the split's
    renamed node ids, mapped back to the task's."""
    status = run.status
    if raw is None:
        tail = (run.stdout + run.stderr).strip()[-300:]
        return _zero(f"no test report (the run ended early: {run.status}, {run.reason}): {tail}", status=status)
    try:
        outer = json.loads(raw)
        body, mac = outer["body"], outer["mac"]
        good = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(good, str(mac)):
            return _zero("the test report is forged (bad signature)", status=status)
        report: dict[str, Any] = json.loads(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        return _zero("the test report is not readable", status=status)
    back = {new: old for old, new in (renamed or {}).items()}
    phases: dict[str, dict[str, str]] = {back.get(n, n): p for n, p in report.get("phases", {}).items()}
    failures: dict[str, list[str]] = {back.get(n, n): f for n, f in report.get("failures", {}).items()}
    collected: list[str] = [back.get(n, n) for n in report.get("collected", [])]
    tampered = list(report.get("tampered", []))
    unexpected = [n for n in collected if _expected_of(n, task.tests) is None]
    if unexpected:
        tampered.append(f"tests that were not asked for ran: {', '.join(unexpected[:5])}")
    f2p = {n: _passed(n, phases) for n in task.fail_to_pass}
    p2p = {n: _passed(n, phases) for n in task.pass_to_pass}
    all_passed = all(f2p.values()) and all(p2p.values())
    if all_passed and report.get("exit_code") != 0:
        tampered.append(f"every test passed but pytest exited with {report.get('exit_code')}")
    verdict = Verdict(0.0, "", f2p, p2p, tampered=tampered, wall_s=run.wall_s, status=status,
                      assertions=[f"{n}: {why}" for n, whys in failures.items() for why in whys[:1]][:20])
    if tampered:
        verdict.reason = f"test run tampered with: {tampered[0]}"
    elif all_passed:
        verdict.value = 1.0
        verdict.reason = f"all {len(f2p)} FAIL_TO_PASS and {len(p2p)} PASS_TO_PASS tests pass"
    else:
        failing = verdict.failing
        verdict.reason = (
            f"{sum(f2p.values())}/{len(f2p)} FAIL_TO_PASS and {sum(p2p.values())}/{len(p2p)} PASS_TO_PASS pass;"
            f" failing: {', '.join(failing[:5])}{' …' if len(failing) > 5 else ''}"
        )
    return verdict


def _expected_of(nodeid: str, expected: tuple[str, ...]) -> str | None:
    for e in expected:
        if nodeid == e or nodeid.startswith(e + "[") or nodeid.startswith(e + "::"):
            return e
    return None


def _passed(expected: str, phases: dict[str, dict[str, str]]) -> bool:
    runs = [p for n, p in phases.items() if _expected_of(n, (expected,)) is not None]
    return bool(runs) and all(p.get("call") == "passed" and set(p.values()) == {"passed"} for p in runs)


def _zero(reason: str, dropped: list[tuple[str, str]] | None = None, *, status: str = "") -> Verdict:
    return Verdict(0.0, reason, dropped=list(dropped or []), status=status)
