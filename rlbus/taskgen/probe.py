"""A pytest plugin the generator loads inside the sandbox: per-test outcomes and, optionally, coverage.

It runs in the sandbox's interpreter next to the library's own test suite, so it may import only the
standard library and pytest (never rlbus). The generator copies this file into the world directory as
``rlbus_swegen_probe.py`` and loads it with ``-p rlbus_swegen_probe``; it is configured by environment
variables because the sandbox clears the environment and the command line belongs to pytest:

    SWEGEN_REPORT   path of the JSON report written at the end of the session (required)
    SWEGEN_TRACE    a directory: record which functions defined under it each test calls

Why tracing and not coverage.py: the sandbox runtime has pytest and hypothesis only, and the generator needs
test → function (to pick a function some tests exercise and to run only the files that exercise it), which
a call-event profile gives directly; line coverage would be more than is needed.

The report: ``{"rootdir": str, "tests": [{"nodeid", "outcome", "error"?}], "calls"?: {nodeid: [[file,
firstlineno, qualname], …]}}``; ``outcome`` is passed / failed / skipped / error (setup or teardown failed)
and ``error`` is ``{"type", "message", "frames": [[file, line, function], …]}`` for failures.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

_RESULTS: dict[str, dict[str, Any]] = {}
_CALLS: dict[str, set[tuple[str, int, str]]] = {}
_ORDER: list[str] = []
_STATE: dict[str, Any] = {"collect_errors": []}


def _trace_root() -> str | None:
    root = os.environ.get("SWEGEN_TRACE")
    return os.path.realpath(root) + os.sep if root else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    root = _trace_root()
    if root is None:
        yield
        return
    seen: set[tuple[str, int, str]] = set()
    cache: dict[Any, tuple[str, int, str] | None] = {}

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code in cache:
            key = cache[code]
        else:
            path = os.path.realpath(code.co_filename)
            key = (path[len(root) :], code.co_firstlineno, code.co_qualname) if path.startswith(root) else None
            cache[code] = key
        if key is not None:
            seen.add(key)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        _CALLS.setdefault(item.nodeid, set()).update(seen)


def _error(report: Any) -> dict[str, Any] | None:
    excinfo = getattr(report, "_swegen_excinfo", None)
    if excinfo is None:
        return {"type": "Error", "message": str(report.longrepr)[-2000:], "frames": []}
    frames = [[str(entry.path), entry.lineno + 1, entry.name] for entry in excinfo.traceback]
    return {"type": excinfo.typename, "message": str(excinfo.value)[:4000], "frames": frames[-30:]}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None:
        report._swegen_excinfo = call.excinfo


def pytest_runtest_logreport(report: Any) -> None:
    entry = _RESULTS.get(report.nodeid)
    if entry is None:
        entry = _RESULTS[report.nodeid] = {"nodeid": report.nodeid, "outcome": "passed"}
        _ORDER.append(report.nodeid)
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry.setdefault("error", _error(report))
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _STATE["collect_errors"].append({"nodeid": report.nodeid, "message": str(report.longrepr)[-2000:]})


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("SWEGEN_REPORT")
    if not path:
        return
    document: dict[str, Any] = {
        "rootdir": str(session.config.rootpath),
        "exitstatus": int(exitstatus),
        "tests": [_RESULTS[nodeid] for nodeid in _ORDER],
        "collect_errors": _STATE["collect_errors"],
    }
    if _trace_root() is not None:
        document["calls"] = {nodeid: sorted(calls) for nodeid, calls in _CALLS.items()}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)
