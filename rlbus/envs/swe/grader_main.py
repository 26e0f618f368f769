"""The test launcher that runs *inside* the sandbox (with the runtime's Python, never imported by rlbus).

It is started as ``python -I -B grader_main.py RUNTIME REPORT REPO EXTRA -- PYTEST_ARGS…`` with a one-time
key on stdin (RUNTIME: where the test runtime is mounted; the launcher itself is mounted elsewhere, in
grading sandboxes only), and is the only trusted code in a process that will import the repository under
test. So it does everything that matters before that code exists in the process, and checks afterwards that
nothing it relies on was touched:

1. reads the key from stdin (then closes it), cleans the pytest variables from the environment, and
   builds ``sys.path`` itself (``-I``: no PYTHONPATH, no user site, no script directory games): the runtime
   first — so a ``pytest.py`` / ``_pytest/`` in the repository can never shadow the real one — then the
   standard library, then the repository root and the task's extra source directories;
2. fingerprints pytest's and pluggy's code (the identity of every function, class and class attribute
   of the modules that run tests and build reports);
3. runs ``pytest.main`` with its own plugin, which records each test phase's verdict from the call's
   exception info itself (not from the report object, which a makereport hook could rewrite), checks after
   collection and at the end that every registered plugin comes from the runtime, the standard library or
   one of the repository's conftest files (whose content the reward worker has reset to the base), and
   re-checks the fingerprint after every test;
4. loads a hypothesis profile without deadlines and with a fixed example sequence (``derandomize``), so
   a verdict does not depend on the machine's load or on luck (a repository's own profile still wins);
5. writes the report (verdicts, collected ids, tamper findings, pytest's exit code) with an HMAC-SHA256
   under the key, to a path outside the repository, and exits with pytest's exit code.

A process that exits early (``os._exit(0)`` at import) leaves no report and scores 0; a forged report
fails the HMAC; patched reporting shows up in the fingerprint.
"""

import hashlib
import hmac
import json
import os
import sys
import threading
import types

_SELF = os.path.abspath(__file__)
_CHECKED = (
    "_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.main", "_pytest.nodes",
    "_pytest.outcomes", "_pytest.skipping", "_pytest.config", "_pytest.fixtures", "_pytest.unittest",
    "pluggy._hooks", "pluggy._callers", "pluggy._manager", "pluggy._result",
)  # fmt: skip


def _fingerprint() -> dict[str, object]:
    out: dict[str, object] = {}
    for name in _CHECKED:
        module = sys.modules[name]
        for key, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                out[f"{name}.{key}"] = value
                for attr, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, property | staticmethod | classmethod):
                        out[f"{name}.{key}.{attr}"] = member
            elif isinstance(value, types.FunctionType):
                out[f"{name}.{key}"] = value
    return out


def _from_runtime(obj: object, site: str) -> bool:
    """Whether a replacement comes from pytest itself (legacypath patches Config in pytest_configure)."""
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    return code is not None and code.co_filename.startswith(site + os.sep)


def main() -> int:
    key = sys.stdin.buffer.read(64)
    sys.stdin.close()
    runtime, report_path, repo, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    args = sys.argv[sys.argv.index("--") + 1 :]
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP"):
        os.environ.pop(name, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    site = os.path.join(runtime, "site")
    stdlib = [p for p in sys.path if p and not p.startswith(os.path.dirname(_SELF))]
    sys.path[:] = [site, *stdlib, repo, *(os.path.join(repo, e) for e in extra.split(":") if e)]
    os.chdir(repo)

    import pytest

    for name in _CHECKED:
        __import__(name)
    baseline = _fingerprint()
    trusted = (site + os.sep, *(p + os.sep for p in stdlib))

    class Grader:
        def __init__(self) -> None:
            self.phases: dict[str, dict[str, str]] = {}
            self.collected: list[str] = []
            self.tampered: list[str] = []
            self.config: object = None

        def check(self, when: str) -> None:
            now = _fingerprint()
            changed = sorted(
                k for k in baseline if now.get(k) is not baseline[k] and not _from_runtime(now.get(k), site)
            )
            if changed:
                self.tampered.append(f"{when}: pytest internals replaced: {', '.join(changed[:5])}")
            manager = getattr(self.config, "pluginmanager", None)
            for plugin in manager.get_plugins() if manager is not None else ():
                module = plugin if isinstance(plugin, types.ModuleType) else sys.modules.get(type(plugin).__module__)
                path = os.path.abspath(getattr(module, "__file__", None) or "?")
                conftest = os.path.basename(path) == "conftest.py" and path.startswith(repo + os.sep)
                if not (path == _SELF or path.startswith(trusted) or conftest):
                    self.tampered.append(f"{when}: foreign pytest plugin from {path}")

        def pytest_configure(self, config: object) -> None:
            self.config = config

        def pytest_collection_finish(self, session: pytest.Session) -> None:
            self.collected = [item.nodeid for item in session.items]
            self.check("collection")

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):
            yield
            excinfo = call.excinfo
            if excinfo is None:
                verdict = "passed"
            elif excinfo.errisinstance(pytest.skip.Exception):
                verdict = "skipped"
            else:
                verdict = "failed"
            self.phases.setdefault(item.nodeid, {})[call.when] = verdict

        def pytest_runtest_logfinish(self, nodeid: str) -> None:
            self.check(nodeid)

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self) -> None:
            self.check("end")
            others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            if others:
                self.tampered.append(f"threads still running at the end: {', '.join(others[:5])}")

    try:  # reproducible verdicts on loaded machines: no deadlines, a fixed example sequence, no database
        from hypothesis import settings

        settings.register_profile("rlbus-grader", deadline=None, derandomize=True, database=None)
        settings.load_profile("rlbus-grader")
    except ImportError:
        pass
    grader = Grader()
    code = int(pytest.main([*args, "--confcutdir", repo, "--rootdir", repo], plugins=[grader]))
    phases = json.loads(json.dumps(grader.phases))  # one snapshot, taken once pytest has returned
    body = json.dumps(
        {"exit_code": code, "phases": phases, "collected": grader.collected, "tampered": grader.tampered[:20]},
        sort_keys=True,
    )
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    with open(report_path, "w") as f:
        json.dump({"body": body, "mac": mac}, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
