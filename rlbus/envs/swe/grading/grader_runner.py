"""The test process of a grade: runs pytest on the repository under test, reports to the launcher, decides nothing.

Started by `rlbus.envs.swe.grading.grader_main` (the launcher, which never imports the repository) as
``python -I -B grader_runner.py RUNTIME FD REPO EXTRA -- PYTEST_ARGS…``, with the hidden tests' visible
code (`rlbus.envs.swe.grading.split`: the assertions report their computed operands, the answers are not there)
on stdin. FD is this process's end of a Unix socket the launcher reads. This is the only process that
imports code under test, so it holds nothing that decides the reward: no key, no expected value, no
verdict. In order, before any repository code can exist:

1. **The channel, kernel-guarded.** The process makes itself non-dumpable (no process of its uid can read
   its memory through ``/proc`` or ``ptrace``) and installs the seccomp filter of
   `rlbus.envs.swe.grading.grader_seccomp`: neither it nor any process it starts can close, ``dup2`` over or
   duplicate the channel, undo the non-dumpable flag, or read another process's memory.
2. **An audit hook** (PEP 578, `rlbus.envs.swe.grading.grader_guard`, in a namespace of its own), not removable
   from Python: the only writer of records, each prefixed with a token no object refers to. It refuses
   introspection that could reach it or the runner while repository code is on the stack (``gc`` walks,
   frames, tracing, ``ctypes``, new code objects, ``__code__`` swaps, pytest's classes, ``/proc``, the
   grader's paths) and sends each refusal as a tamper finding.
3. **pytest and the test helpers imported, the hidden tests compiled** from the bytes on stdin, never from
   the repository's disk: ``CHECK``, ``REG``, every slot and every ``pytest`` / ``unittest`` /
   ``hypothesis`` name the tests use become constants of the code objects. A meta-path finder serves those
   modules; nothing of the repository can be imported yet (its directories are not on ``sys.path``, and
   the finder refuses a module from them until collection starts). Then the baseline: pytest's and
   ``builtins``' helpers fingerprinted, compared again at every test.
4. **pytest runs** (assertion rewriting off: the hidden tests' assertions are already ``CHECK`` calls). The
   repository joins ``sys.path`` when collection starts. The hook runs each collected test function itself
   (``rlbus.grader.run``) if it is one the hidden tests defined (by identity), and records whether it
   returned; ``CHECK`` reports each assertion with the test that made it.

What stays in process is listed in docs/architecture.md ("The grader's trust boundary").
"""

import os
import sys
from typing import Any


def _read_plan() -> dict:
    import json

    data = sys.stdin.buffer.read()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, empty
    plan = json.loads(data)
    if type(plan) is not dict or type(plan.get("files")) is not dict:
        raise SystemExit("rlbus grader: no test plan on stdin")
    return plan


def _load(here: str, *names: str) -> dict[str, Any]:
    """The files ``names`` run, in order, into one private namespace with a copy of ``builtins``."""
    import builtins

    namespace: dict[str, Any] = {"__builtins__": dict(vars(builtins)), "__name__": "rlbus_grader_guard"}
    for name in names:
        path = os.path.join(here, name)
        with open(path, "rb") as f:
            exec(compile(f.read(), path, "exec"), namespace)
    return namespace


def _trusted_classes(prefixes: tuple) -> tuple:
    """Every class a module of the standard library, the runtime or the grader defines at its top level."""
    out = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path is not None and not str(path).startswith(prefixes):
            continue
        out += [v for v in list(vars(module).values()) if isinstance(v, type)]
    return tuple(out)


class HiddenTests:
    """The meta-path finder for the hidden tests: each module whose file is one of them is served from the
    code compiled from stdin. Until `open` is called (collection starts) a module of the repository is not
    imported at all."""

    def __init__(self, code: dict, repo: str, path_finder: Any) -> None:
        self.code = code
        self.repo = repo.rstrip(os.sep) + os.sep
        self.path_finder = path_finder
        self.opened = False

    def open(self) -> None:
        self.opened = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        spec = self.path_finder.find_spec(fullname, path)
        origin = getattr(spec, "origin", None)
        if spec is None or type(origin) is not str:
            return None
        code = self.code.get(os.path.realpath(origin))
        if code is not None:
            spec.loader = _Loader(code)
            spec.cached = None
            return spec
        if not self.opened and os.path.realpath(origin).startswith(self.repo):
            raise ModuleNotFoundError(f"{fullname} is not importable before the tests are collected", name=fullname)
        return None


class _Loader:
    def __init__(self, code: Any) -> None:
        self.code = code

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        exec(self.code, module.__dict__)


def main() -> int:
    runtime, fd, repo, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    args = sys.argv[sys.argv.index("--") + 1 :]
    here = os.path.dirname(os.path.abspath(__file__))
    plan = _read_plan()
    seccomp = _load(here, "grader_seccomp.py")
    seccomp["not_dumpable"]()
    seccomp["install"](fd)
    os.set_inheritable(fd, False)  # a program it execs does not get it (forked children do: a second writer)
    site = os.path.join(runtime, "site")
    stdlib = [p for p in sys.path if p and not p.startswith(here)]
    sources = {os.path.realpath(os.path.join(repo, p)): text for p, text in plan["files"].items()}
    trusted_files = frozenset(sources)
    trusted = tuple(p.rstrip(os.sep) + os.sep for p in (site, here, *stdlib))  # the runtime, the grader, the stdlib
    exposed = _load(here, "grader_values.py", "grader_guard.py")["exposed"]()
    hook = _load(here, "grader_values.py", "grader_guard.py")
    guard = hook["install"](
        fd,
        trusted_prefixes=(*trusted, "<frozen "),
        trusted_files=trusted_files,
        guarded_paths=(here, os.path.join(os.path.dirname(repo), "grade")),
        exposed=exposed,
    )
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP"):
        os.environ.pop(name, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    sys.path[:] = [site, *stdlib]  # the repository joins at collection, after every trusted import
    os.chdir(repo)

    import importlib
    import importlib.machinery
    import inspect
    import threading
    import types

    import pytest

    for name in (*hook["FINGERPRINTED"], "unittest.mock", "hypothesis", "hypothesis.strategies"):
        try:
            importlib.import_module(name)
        except ImportError:  # modules of another pytest version
            pass

    def resolve(name: str) -> Any:
        module, _, attr = name.partition(":")
        value = importlib.import_module(module)
        return getattr(value, attr) if attr else value

    code = guard["compile"](sources, resolve)
    finder = HiddenTests(code, repo, importlib.machinery.PathFinder)
    sys.meta_path.insert(0, finder)
    repo_paths = [repo, *(os.path.join(repo, e) for e in extra.split(":") if e)]
    from _pytest.unittest import TestCaseFunction as unittest_item

    handle = getattr(sys.modules.get("hypothesis.core"), "HypothesisHandle", None)  # @given's record of the test
    guard["baseline"](_trusted_classes(trusted), handle)
    audit = sys.audit
    audit("rlbus.grader.baseline", unittest_item)

    class Runner:
        def __init__(self) -> None:
            self.config = None

        def plugins(self, when: str) -> None:
            manager = getattr(self.config, "pluginmanager", None)
            for plugin in manager.get_plugins() if manager is not None else ():
                module = plugin if isinstance(plugin, types.ModuleType) else sys.modules.get(type(plugin).__module__)
                path = os.path.realpath(getattr(module, "__file__", None) or "?")
                if not (path.startswith(trusted) or path in trusted_files):
                    audit("rlbus.grader.tamper", f"{when}: foreign pytest plugin from {path}")

        @pytest.hookimpl(trylast=True)
        def pytest_configure(self, config) -> None:
            """The debugging plugin keeps the live config on a class (``pytestPDB._config``): the one
            road from a module to pytest's session and items that needs no introspection. Cut it (no
            ``--pdb`` in a grade); unittest items still read their options from their own config."""
            self.config = config
            debugging = sys.modules.get("_pytest.debugging")
            pdb_class = getattr(debugging, "pytestPDB", None)
            if pdb_class is not None:
                pdb_class._config = pdb_class._pluginmanager = None

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection(self, session) -> None:
            sys.path.extend(p for p in repo_paths if p not in sys.path)
            finder.open()

        def pytest_collection_finish(self, session) -> None:
            audit("rlbus.grader.collected", tuple((item.nodeid, getattr(item, "obj", None)) for item in session.items))
            self.plugins("collection")

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_protocol(self, item, nextitem):
            audit("rlbus.grader.begin", item.nodeid)
            try:
                yield
            finally:
                audit("rlbus.grader.begin", None)

        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(self, pyfuncitem) -> bool:
            """The audit hook calls the test function itself (``rlbus.grader.run``) and records whether it
            returned; an exception comes back out of ``sys.audit`` to pytest as the test's failure."""
            function = pyfuncitem.obj
            if inspect.iscoroutinefunction(function):
                pytest.fail(f"{pyfuncitem.nodeid} is async; the grader runs sync tests only", pytrace=False)
            testargs = {arg: pyfuncitem.funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames}
            audit("rlbus.grader.run", pyfuncitem.nodeid, function, testargs)
            return True

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_call(self, item):
            """unittest items never reach ``pytest_pyfunc_call``: their call is recorded around ``runtest``."""
            if not isinstance(item, unittest_item):
                return (yield)
            ok = False
            try:
                result = yield
                ok = True
                return result
            finally:
                audit("rlbus.grader.call", item.nodeid, item, ok)

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_makereport(self, item, call):
            yield
            excinfo = call.excinfo
            if excinfo is None:
                verdict = "passed"
            elif excinfo.errisinstance(pytest.skip.Exception):
                verdict = "skipped"
            else:
                verdict = "failed"
            audit("rlbus.grader.phase", item.nodeid, call.when, verdict)

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self) -> None:
            self.plugins("end")
            others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            if others:
                audit("rlbus.grader.tamper", f"threads still running at the end: {', '.join(others[:5])}")

    try:  # reproducible verdicts on loaded machines: no deadlines, a fixed example sequence, no database
        from hypothesis import settings

        settings.register_profile("rlbus-grader", deadline=None, derandomize=True, database=None)
        settings.load_profile("rlbus-grader")
    except ImportError:
        pass
    argv = [*args, "--confcutdir", repo, "--rootdir", repo, "--assert=plain"]
    code_ = int(pytest.main(argv, plugins=[Runner()]))
    audit("rlbus.grader.end", code_)
    return code_


if __name__ == "__main__":
    sys.exit(main())
