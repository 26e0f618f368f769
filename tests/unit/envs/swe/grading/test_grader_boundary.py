"""The launcher's side of the grader's trust boundary: what it believes of the runner's socket, how it judges
each assertion with the answers only it holds, and the kernel's part — the seccomp filter and the
non-dumpable processes (docs/architecture.md, "The grader's trust boundary")."""

from __future__ import annotations

import json
from typing import Any

from rlbus.envs.swe.grading import grader_main, grader_values
from rlbus.envs.swe.runtime import GRADER_INNER, INNER
from rlbus.envs.swe.task import RepoTask
from rlbus.envs.swe.world import task_sandbox

TOKEN = "ab" * 16
RUNNER = 7
NODE = "t.py::test_a"
#: Slot 1: ``assert f() == 5`` (mandatory); slot 2: ``assert g() != h()``; slot 3: approx 0.3.
SLOTS = {
    "1": {"op": "==", "path": "t.py", "line": 3, "layout": "ca", "answers": {"1": ["I", "0x5"]}, "group": 1,
          "mandatory": True},
    "2": {"op": "!=", "path": "t.py", "line": 4, "layout": "cc", "answers": {}, "group": 1, "mandatory": False},
    "3": {"op": "approx", "path": "t.py", "line": 5, "layout": "c~", "answers": {"1": ["F", (0.3).hex()]},
          "tolerance": {}, "group": 1, "mandatory": False},
}  # fmt: skip


def _line(record: dict[str, object], token: str = TOKEN) -> bytes:
    return f"{token} {json.dumps(record)}\n".encode()


def _run(node: str = NODE, ran: bool = True, checks: tuple[dict[str, Any], ...] = ()) -> list[dict[str, Any]]:
    phases = [{"phase": node, "when": w, "verdict": "passed"} for w in ("setup", "call", "teardown")]
    records = [{"hello": RUNNER}, {"collected": [node]}, *({"test": node, **c} for c in checks), *phases]
    return records + ([{"call": node, "ok": True, "fn": 1}] if ran else [])


def _judge(*records: dict[str, Any], returncode: int = 0, extra: tuple[tuple[Any, bytes], ...] = ()) -> dict:
    chunks = [(RUNNER, b"".join(_line(r) for r in records)), *extra]
    tampered: list[str] = []
    got = grader_main.read_records(chunks, RUNNER, tampered)
    return grader_main.judge(got, returncode, tampered, grader_main.Assertions(SLOTS, vars(grader_values)))


def _five(value: Any = 5) -> dict[str, Any]:
    return {"check": 1, "op": "==", "values": [grader_values.encoder()(value)]}


def test_a_run_whose_assertions_hold_passes() -> None:
    report = _judge(*_run(checks=(_five(), {"check": 3, "op": "approx", "values": [["F", (0.1 + 0.2).hex()]]})),
                    {"end": 0})  # fmt: skip
    assert report["tampered"] == [] and report["phases"][NODE]["call"] == "passed"


def test_an_assertion_compared_with_the_answer_the_launcher_holds_fails_the_test() -> None:
    report = _judge(*_run(checks=(_five(4),)), {"end": 0})
    assert report["phases"][NODE]["call"] == "failed" and report["tampered"] == []
    assert report["failures"][NODE] == ["the assertion at t.py:3 (==) did not hold"]  # no answer in the reason


def test_what_the_grader_cannot_read_fails_and_is_reported() -> None:
    unread = {"check": 1, "op": "==", "unverifiable": "a lib.Thing (repo-eq) compared with an answer"}
    report = _judge(*_run(checks=(unread,)), {"end": 0})
    assert report["phases"][NODE]["call"] == "failed" and "cannot read" in report["tampered"][0]


def test_a_test_that_returned_without_its_mandatory_assertion_fails() -> None:
    report = _judge(*_run(checks=({"check": 2, "op": "!=", "result": True},)), {"end": 0})
    assert report["phases"][NODE]["call"] == "failed"
    assert "returned without reaching the assertion at t.py:3" in report["tampered"][0]


def test_a_failing_assertion_outside_any_test_fails_them_all() -> None:
    module_level = {"check": 1, "op": "==", "values": [["I", "0x6"]], "test": None}
    run = _run(checks=(_five(),))
    report = _judge(run[0], module_level, *run[1:], {"end": 0})
    assert report["phases"][NODE]["call"] == "failed"


def test_forged_assertion_reports_are_tampering() -> None:
    report = _judge(*_run(checks=(_five(), {"check": 9, "op": "==", "result": True})), {"end": 0})
    assert "a forged assertion report (9)" in report["tampered"]


def test_a_call_pytest_passed_but_no_function_ran_for_fails() -> None:
    report = _judge(*_run(ran=False), {"end": 0})
    assert report["phases"][NODE]["call"] == "failed"
    assert "never ran under the grader" in report["tampered"][0]


def test_lines_without_the_token_are_forgeries() -> None:
    forged = (RUNNER, _line({"call": NODE, "ok": True}, token="0" * 32))
    report = _judge(*_run(ran=False), {"end": 0}, extra=(forged,))
    assert report["phases"][NODE]["call"] == "failed"
    assert any("without the runner's token" in t for t in report["tampered"])


def test_a_second_writer_and_passed_descriptors_are_tampering() -> None:
    late = (RUNNER + 1, _line({"call": NODE, "ok": True}))
    assert "a second writer (pid 8) on the report channel" in _judge(*_run(), {"end": 0}, extra=(late,))["tampered"]
    assert any("descriptors passed" in t for t in _judge(*_run(), {"end": 0}, extra=((-1, b""),))["tampered"])


def test_duplicates_and_records_after_the_end_are_tampering() -> None:
    assert "the tests were reported collected twice" in _judge(*_run(), {"collected": [NODE]}, {"end": 0})["tampered"]
    assert f"{NODE} reported its call twice" in _judge(*_run(), {"call": NODE, "ok": True}, {"end": 0})["tampered"]
    after = _judge(*_run(), {"end": 0}, {"phase": NODE, "when": "call", "verdict": "passed"})
    assert "a record after the test process's end record" in after["tampered"]


def test_a_failed_subtest_fails_its_test_whatever_follows() -> None:
    report = _judge(*_run()[:2], {"phase": NODE, "when": "call", "verdict": "failed"}, *_run()[2:], {"end": 0})
    assert report["phases"][NODE]["call"] == "failed" and report["tampered"] == []


def test_a_run_without_its_end_or_with_another_exit_code_is_tampered() -> None:
    assert "ended without finishing" in _judge(*_run())["tampered"][0]
    assert "reported exit code 0 but exited with 1" in _judge(*_run(), {"end": 0}, returncode=1)["tampered"][0]


def test_no_token_line_first_is_a_run_that_never_started() -> None:
    tampered: list[str] = []
    assert grader_main.read_records([(RUNNER, _line({"end": 0}, token="short"))], RUNNER, tampered) == []
    assert "did not start its report" in tampered[0]


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


SECCOMP_PROBE = """
import errno, fcntl, os, socket, subprocess, sys
sys.path.insert(0, {inner!r})
import grader_seccomp
ours, theirs = socket.socketpair()
channel = theirs.fileno()
grader_seccomp.install(channel)
spare_r, spare_w = os.pipe()
def attempt(f):
    try:
        f()
        return "allowed"
    except OSError as exc:
        return errno.errorcode[exc.errno]
results = {{
    "dup2": attempt(lambda: os.dup2(spare_w, channel)),
    "dup2_elsewhere": attempt(lambda: os.dup2(spare_w, 60)),
    "close": attempt(lambda: os.close(channel)),
    "F_DUPFD": attempt(lambda: fcntl.fcntl(channel, fcntl.F_DUPFD, 20)),
    "F_GETFL": attempt(lambda: fcntl.fcntl(channel, fcntl.F_GETFL)),
}}
os.closerange(channel, channel + 1)  # close_range refused for it; the fallback's close() too
code = "import os; os.dup2(0, {{}})".format(channel)
child = subprocess.run([sys.executable, "-c", code], pass_fds=(channel,), capture_output=True, text=True)
results["child_dup2"] = "EPERM" if "PermissionError" in child.stderr else child.stderr[-200:]
theirs.sendall(b"still ours")
results["channel"] = ours.recv(100).decode()
print(__import__("json").dumps(results))
"""


async def test_the_seccomp_filter_keeps_the_channel_in_the_sandbox_and_in_children(
    corpus_tasks: dict[str, RepoTask],
) -> None:
    """Inside bubblewrap, as the grading sandbox runs it: dup2 onto the channel, closing it (directly or in a
    range) and duplicating it fail with EPERM, for the process and for a program it starts; other
    descriptors are untouched, and the channel still carries data."""
    async with task_sandbox(corpus_tasks["calc-add"], grading=True) as box:
        box.write("probe.py", SECCOMP_PROBE.format(inner=GRADER_INNER))
        run = await box.run([f"{INNER}/bin/python", "-I", "-B", "/sandbox/probe.py"])
    assert run.ok, run
    assert json.loads(run.stdout) == {
        "dup2": "EPERM", "dup2_elsewhere": "allowed", "close": "EPERM", "F_DUPFD": "EPERM", "F_GETFL": "allowed",
        "child_dup2": "EPERM", "channel": "still ours",
    }  # fmt: skip
