"""The launcher's side of the grader's trust boundary: what it believes of the runner's pipe, and that a
process of the same uid cannot read it (docs/architecture.md, "The grader's trust boundary")."""

from __future__ import annotations

import io
import json

from rlbus.envs.swe import grader_main
from rlbus.envs.swe.runtime import GRADER_INNER, INNER
from rlbus.envs.swe.task import RepoTask
from rlbus.envs.swe.world import task_sandbox

TOKEN = "ab" * 16


def _stream(*lines: str) -> io.BytesIO:
    return io.BytesIO("".join(line + "\n" for line in lines).encode())


def _mark(record: dict[str, object], token: str = TOKEN) -> str:
    return f"{token} {json.dumps(record)}"


def _judge(*lines: str, returncode: int = 0) -> dict[str, object]:
    tampered: list[str] = []
    records = grader_main.read_records(_stream(*lines), tampered)
    return grader_main.judge(records, returncode, tampered)


def _run(node: str, ran: bool) -> list[str]:
    phases = [_mark({"phase": node, "when": w, "verdict": "passed"}) for w in ("setup", "call", "teardown")]
    return [_mark({"hello": 7}), _mark({"collected": [node]}), *phases, *([_mark({"call": node, "ok": True})] * ran)]


def test_a_run_with_every_record_passes() -> None:
    report = _judge(*_run("t.py::test_a", ran=True), _mark({"end": 0}))
    assert report["tampered"] == [] and report["phases"] == {"t.py::test_a": dict.fromkeys(
        ("setup", "call", "teardown"), "passed")}  # fmt: skip


def test_a_call_pytest_passed_but_no_function_ran_for_fails() -> None:
    """pytest's report says passed, but the runner never ran the collected function (runtest replaced)."""
    report = _judge(*_run("t.py::test_a", ran=False), _mark({"end": 0}))
    assert report["phases"]["t.py::test_a"]["call"] == "failed"  # type: ignore[index]
    assert "never ran under the grader" in report["tampered"][0]  # type: ignore[index]


def test_lines_without_the_token_are_forgeries() -> None:
    forged = _mark({"call": "t.py::test_a", "ok": True}, token="0" * 32)
    report = _judge(*_run("t.py::test_a", ran=False), forged, _mark({"end": 0}))
    assert report["phases"]["t.py::test_a"]["call"] == "failed"  # type: ignore[index]
    assert any("without the runner's token" in t for t in report["tampered"])  # type: ignore[union-attr]


def test_a_run_without_its_end_or_with_another_exit_code_is_tampered() -> None:
    assert "ended without finishing" in _judge(*_run("t.py::test_a", ran=True))["tampered"][0]  # type: ignore[index]
    wrong = _judge(*_run("t.py::test_a", ran=True), _mark({"end": 0}), returncode=1)
    assert "reported exit code 0 but exited with 1" in wrong["tampered"][0]  # type: ignore[index]


def test_no_token_line_first_is_a_run_that_never_started() -> None:
    report = _judge(_mark({"end": 0}, token="short"))
    assert "did not start its report" in report["tampered"][0]  # type: ignore[index]


async def test_the_launcher_is_not_readable_by_its_own_uid(corpus_tasks: dict[str, RepoTask]) -> None:
    """After ``_not_dumpable`` a child of the same uid (the runner, or a process code under test starts)
    cannot read the launcher's environment or memory through /proc; before it, it can."""
    script = (
        "import os, subprocess, sys\n"
        f"sys.path.insert(0, {GRADER_INNER!r})\n"
        "import grader_main\n"
        "def peek():\n"
        "    return subprocess.run(['cat', f'/proc/{os.getpid()}/environ'], capture_output=True).returncode\n"
        "before = peek()\n"
        "grader_main._not_dumpable()\n"
        "print(before, peek())\n"
    )
    async with task_sandbox(corpus_tasks["calc-add"], grading=True) as box:
        box.write("peek.py", script)
        run = await box.run([f"{INNER}/bin/python", "-I", "-B", "/sandbox/peek.py"])
    assert run.ok, run
    before, after = run.stdout.split()
    assert before == "0" and after != "0", run.stdout
