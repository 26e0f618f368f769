"""Sandboxed pytest runs: outcomes per node id relative to the repository, collection errors, tracing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlbus.taskgen.runner import RunReport, TestRunner, _parse


def test_node_ids_are_made_relative_to_the_repository_root() -> None:
    document = {
        "rootdir": "/sandbox/repo/pkg",
        "tests": [{"nodeid": "tests/test_a.py::test_x", "outcome": "failed", "error": {"type": "E"}}],
        "collect_errors": [],
        "calls": {"tests/test_a.py::test_x": [["pkg/mod.py", 3, "f"]]},
    }
    report = _parse(document, RunReport("error", 1.0), "/sandbox/repo")
    assert list(report.tests) == ["pkg/tests/test_a.py::test_x"]
    assert report.calls == {"pkg/tests/test_a.py::test_x": [("pkg/mod.py", 3, "f")]}


def test_outcomes_errors_and_calls_from_a_real_sandboxed_run(tmp_path: Path) -> None:
    (tmp_path / "lib.py").write_text("def half(x):\n    return x / 2\n")
    (tmp_path / "test_lib.py").write_text(
        "from lib import half\n\n"
        "def test_ok():\n    assert half(4) == 2\n\n"
        "def test_bad():\n    assert half(4) == 3, 'half is off'\n"
    )
    (tmp_path / "test_broken.py").write_text("import does_not_exist\n")

    async def go() -> tuple[RunReport, RunReport]:
        with TestRunner(timeout_s=60) as runner:
            good = await runner.run(tmp_path, ["test_lib.py"], trace="")
            broken = await runner.run(tmp_path, ["test_broken.py"])
        return good, broken

    good, broken = asyncio.run(go())
    assert (
        good.usable
        and good.ids("passed") == ["test_lib.py::test_ok"]
        and good.ids("failed") == ["test_lib.py::test_bad"]
    )
    error = good.tests["test_lib.py::test_bad"].error
    assert error is not None and error["type"] == "AssertionError" and "half is off" in error["message"]
    assert ("lib.py", 1, "half") in good.calls["test_lib.py::test_ok"]
    assert not broken.usable and "does_not_exist" in broken.collect_errors[0]["message"]
