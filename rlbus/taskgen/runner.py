"""Run a repository's tests in the bubblewrap sandbox and read back per-test outcomes.

Everything the generator learns about a library comes from running its own suite on code it did not write
— the unchanged release, then each mutant — so every run goes through `rlbus.sandbox.Sandbox` (no
network, rlimits, a private world directory), never a bare subprocess. A run copies the repository into a
fresh world as ``repo/``, hard-links the pytest runtime (`runtime`) next to it as ``_rt/``, adds the probe
plugin (`probe`), and reads the JSON report the plugin wrote. Node ids are made relative to the repository
root whatever rootdir pytest chose, because those are what task.toml lists and what the grader passes back.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.sandbox import SANDBOX_DIR, Sandbox, SandboxLimits
from rlbus.taskgen import runtime

_PROBE = Path(__file__).with_name("probe.py")
_PYTHON = "/usr/bin/python3"


@dataclass
class TestOutcome:
    __test__ = False  # not a pytest test class

    nodeid: str
    outcome: str
    """passed, failed, skipped or error."""
    error: dict[str, Any] | None = None


@dataclass
class RunReport:
    """One pytest run: outcomes by node id, collection errors, the sandbox status and wall time."""

    status: str
    wall_s: float
    tests: dict[str, TestOutcome] = field(default_factory=dict)
    collect_errors: list[dict[str, Any]] = field(default_factory=list)
    calls: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    stderr: str = ""

    def ids(self, outcome: str) -> list[str]:
        return [t.nodeid for t in self.tests.values() if t.outcome == outcome]

    @property
    def usable(self) -> bool:
        """The run finished (no timeout, no crash) and every file collected."""
        return self.status in ("ok", "error") and not self.collect_errors and bool(self.tests)


class TestRunner:
    """Runs pytest over repositories in sandboxes that share one staged runtime directory."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, *, timeout_s: float = 120.0, memory_mb: int = 2048, processes: int = 64) -> None:
        self.limits = SandboxLimits(
            wall_s=timeout_s, cpu_s=int(timeout_s), memory_mb=memory_mb, processes=processes, file_size_mb=64
        )
        self._staged: Path | None = None

    def __enter__(self) -> TestRunner:
        self._staged = Path(tempfile.mkdtemp(prefix="rlbus-swegen-rt-"))
        runtime.build(self._staged / "_rt")
        shutil.copy2(_PROBE, self._staged / "_rt" / "rlbus_swegen_probe.py")
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    async def run(
        self,
        repo: Path,
        tests: Sequence[str] = (),
        *,
        src: str = "",
        trace: str | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> RunReport:
        """Run ``tests`` (node ids or files; all when empty) in a copy of ``repo``.

        ``overrides`` replaces files of the copy (repository-relative path → text), how a mutant is run
        without a second copy; ``trace`` (a repository-relative directory, "" for all of it) records which
        of its functions each test calls.
        """
        if self._staged is None:
            raise RuntimeError("use `with TestRunner() as runner`")
        async with Sandbox(limits=self.limits, python=_PYTHON) as box:
            world = box.path
            shutil.copytree(repo, world / "repo", symlinks=True)
            for relative, text in (overrides or {}).items():
                (world / "repo" / relative).write_text(text, encoding="utf-8")
            runtime.link_tree(self._staged / "_rt", world / "_rt")
            if box.uid is not None:
                _chown_tree(world, box.uid)
            inner_repo = f"{SANDBOX_DIR}/repo"
            path = [f"{SANDBOX_DIR}/_rt", f"{inner_repo}/{src}" if src else inner_repo]
            env = [f"PYTHONPATH={':'.join(path)}", f"SWEGEN_REPORT={SANDBOX_DIR}/report.json"]
            if trace is not None:
                env.append(f"SWEGEN_TRACE={inner_repo}/{trace}" if trace else f"SWEGEN_TRACE={inner_repo}")
            pytest = [_PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "rlbus_swegen_probe", *tests]
            script = f"cd {inner_repo} && exec env {' '.join(map(shlex.quote, env))} {shlex.join(pytest)}"
            result = await box.run(["/bin/sh", "-c", script])
            raw = box.read_file("report.json", max_bytes=64 * 1024 * 1024)
        report = RunReport(result.status, result.wall_s, stderr=(result.stdout + result.stderr)[-4000:])
        if raw is None:
            if result.status in ("ok", "error"):
                report.status = "crashed"
            return report
        return _parse(json.loads(raw), report, inner_repo)


def _parse(document: dict[str, Any], report: RunReport, inner_repo: str) -> RunReport:
    rootdir = document.get("rootdir", inner_repo)
    prefix = os.path.relpath(rootdir, inner_repo)
    prefix = "" if prefix == "." else prefix + "/"

    def fix(nodeid: str) -> str:
        return prefix + nodeid

    for entry in document.get("tests", []):
        nodeid = fix(entry["nodeid"])
        report.tests[nodeid] = TestOutcome(nodeid, entry["outcome"], entry.get("error"))
    report.collect_errors = document.get("collect_errors", [])
    for nodeid, calls in document.get("calls", {}).items():
        report.calls[fix(nodeid)] = [(str(f), int(line), str(name)) for f, line, name in calls]
    return report


def _chown_tree(root: Path, uid: int) -> None:
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(directory, name), uid, uid)
