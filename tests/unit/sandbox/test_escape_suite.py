"""The sandbox escape suite of ``rlbus bench sandbox``: every hostile answer must be contained.

Each attempt runs through the ``python_fn`` reward path and is judged by host-side checks as well as by
what the sandbox reported (see `rlbus_tools.bench.escapes`). Like the sandbox tests, these need ``bwrap``
(Debian package ``bubblewrap``) and fail — never skip — without it: a machine that lost the package must
not pass by running nothing.
"""

from __future__ import annotations

import os
import time

import pytest

from rlbus.errors import SandboxError
from rlbus.sandbox import SandboxResult, find_bwrap
from rlbus_tools.bench import escapes as suite

#: Every attempt the suite is expected to make; a silently dropped attempt fails the test.
EXPECTED = {
    "fork_bomb", "memory_hog", "infinite_loop_cpu", "sleep_forever_wall_clock", "daemon_outlives_run",
    "network_host_loopback", "read_etc_shadow", "read_home_and_ssh", "read_repository_files",
    "symlink_results_to_host_file", "fifo_results_blocks_worker", "write_outside_sandbox", "kill_parent",
    "kill_all", "environment_variables", "proc_escape", "privilege_regain",
}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.slow
async def test_every_escape_is_contained() -> None:
    try:
        find_bwrap()
    except SandboxError as exc:  # a failure in the test itself, so it reads FAILED, not skipped or errored
        pytest.fail(f"{exc} — the escape suite needs it (CI installs it).", pytrace=False)
    start = time.monotonic()
    escapes = await suite.escape_suite()
    elapsed = time.monotonic() - start
    assert {e.name for e in escapes} == EXPECTED and len(escapes) == len(EXPECTED)
    failed = {e.name: [line for line in e.evidence if line.startswith("NOT CONTAINED")] for e in escapes}
    assert all(e.contained for e in escapes), {name: lines for name, lines in failed.items() if lines}
    for escape in escapes:
        assert escape.status in {"ok", "error", "killed", "timeout"}, escape  # a result came back every time
        assert escape.evidence and not any(line.startswith("NOT CONTAINED") for line in escape.evidence)
    assert suite._SECRET_ENV not in os.environ  # the planted secret is removed again
    assert elapsed < 120, f"the escape suite took {elapsed:.1f}s"  # a hang, not speed: that is benched


async def test_the_judge_can_say_not_contained() -> None:
    """A leak in any channel, or an action that succeeded, must fail the attempt and be redacted from evidence.

    Runs no sandbox (no bwrap needed): it guards against a judge that could only ever say "contained".
    """
    host = suite._plant()
    try:
        result = SandboxResult("ok", 0, "exited normally", f"env: {host.secret_value}", "", 0.1)
        report = {"/etc/shadow": "OK: 'root:$6$hash'", "/root": "DENIED: FileNotFoundError"}
        run = suite._Run(result, [{"ok": True, "value": report}], 0.1)
        escape = await suite._judge("synthetic_leak", run, host, suite._denied(run), "contained")
    finally:
        host.secret_file.unlink()
    assert not escape.contained and escape.summary.startswith("NOT CONTAINED")
    assert host.secret_value not in str(escape) and "$6$hash" not in str(escape)
    failures = [line for line in escape.evidence if line.startswith("NOT CONTAINED")]
    assert any("/etc/shadow → OK (" in line and "withheld" in line for line in failures)
    assert any("the worker's secret env var" in line for line in failures)
    silent = suite._Run(SandboxResult("error", 1, "boom", "", "", 0.1), "sandbox error: boom", 0.1)
    assert not suite._denied(silent)[0][0]  # no report: nothing shows the attack was stopped
