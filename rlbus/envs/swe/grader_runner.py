"""The test process of a grade: runs pytest on the repository under test, reports to the launcher, decides nothing.

Started by `rlbus.envs.swe.grader_main` (the launcher, which never imports the repository) as
``python -I -B grader_runner.py RUNTIME FD REPO EXTRA TRUSTED -- PYTEST_ARGS…``: FD is the write end of a
pipe the launcher reads, TRUSTED a ``:``-separated list of repository files no patch can have changed (the
hidden tests, the template's test files and conftest). This is the only process that imports code under
test, so it holds nothing that decides the reward: no signing key (the launcher signs), no verdict (the
launcher judges). What it reports is guarded by a Python audit hook (PEP 578, `rlbus.envs.swe.grader_guard`,
loaded into a namespace of its own), installed before anything else is imported and not removable from
Python; code under test may not add hooks of its own:

* **A channel only the hook can write.** The hook makes a random token, sends it as the pipe's first line
  before any repository code exists, and keeps it in its closure: no module, object or frame refers to it.
  Every record is written by the hook, prefixed with the token; a line without it (code under test writing
  to the pipe's descriptor) is a forgery the launcher sees. Records are asked for with ``sys.audit`` events
  (``rlbus.grader.*``), and the hook accepts the ones that decide a verdict only when no repository frame
  is on the stack: repository code cannot call them, nor sit between pytest and the test function.
* **The hook runs the test function itself.** It keeps the functions collected (nodeid → function); the
  runner's ``pytest_pyfunc_call`` hands it the test's function and arguments (``rlbus.grader.run``), and
  the hook refuses another function or a second run, calls it, and records whether it returned — a
  verdict that never exists outside the hook's frame (the runner's own objects, reachable through
  ``object.__subclasses__()`` and closures, decide nothing). A test whose function never ran there
  (``runtest`` replaced, a plugin answering ``pytest_pyfunc_call`` first) has no ``call`` record, and
  fails. unittest items never reach ``pytest_pyfunc_call``: their call is recorded around ``runtest``.
* **Introspection is refused and recorded** while repository code is on the stack: ``gc`` object walks,
  frames (``sys._getframe``, traceback and generator frames, ``inspect``/``traceback``/``logging`` helpers
  that return them), ``sys.settrace``/``setprofile``, ``ctypes``, new code objects, replacing a function's
  ``__code__``, setting attributes of pytest's, pluggy's or hypothesis's classes, opening ``/proc`` or the
  grader's paths, and compiling code under a trusted file name. The stdlib's own uses (``namedtuple``,
  ``typing``, ``logging``'s caller lookup, formatting a traceback) stay allowed. Each refusal raises
  ``PermissionError`` and is sent as a tamper finding: the grade is 0.
* **pytest's and the test's helpers are compared, by identity, at every test** (``FINGERPRINTED`` and
  ``builtins``): a patched ``pytest.raises`` or ``CallInfo`` is a tamper finding.
* **Negative controls** (``make_probe`` in the guard): the trusted test files' ``==`` / ``!=`` assertions and
  ``assertEqual`` calls are rewritten (`_controls`, before any repository code runs) to compare both sides
  with a fresh object, and with a different value of the other side's type; a value that equals it (the
  "always equal" hack, by ``__eq__``, a subclass, a metaclass or a borrowed ``mock.ANY.__eq__``) is a tamper
  finding, whatever the task.

What remains in-process (docs/architecture.md, "The grader's trust boundary"): code under test can still
change *data* the tests use without introspection (a test module's globals, a fixture's value reachable
from a module), and restore a patched helper between the test's return and the check. The hack monitor
(`rlbus.envs.swe.monitor`) reads the patch for those.
"""

import os
import sys
from typing import Any


def _subclasses(klass: type) -> list[type]:
    out = [klass]
    subs: list[type] = klass.__subclasses__()
    for sub in subs:
        out += _subclasses(sub)
    return out


#: The name the hidden tests' rewritten assertions call the probe by (a builtin; fingerprinted).
_PROBE = "_rlbus_grader_probe"


def _controls(source: bytes, path: str) -> str:
    """``source`` (a hidden test file) with ``A == B`` / ``A != B`` in its ``assert`` statements and its
    ``assertEqual`` calls rewritten to the probe's call. Done before any repository code runs: what the
    runner later hands pytest is this text, compiled, never a transformation code under test could reach."""
    import ast

    tree = ast.parse(source, path)

    class Controls(ast.NodeTransformer):
        in_assert = False

        def visit_Assert(self, node: ast.Assert) -> ast.Assert:
            self.in_assert = True
            node.test = self.visit(node.test)
            self.in_assert = False
            return node

        def visit_Call(self, node: ast.Call) -> ast.expr:
            """``self.assertEqual(A, B, …)`` → ``self.assertEqual(*probe(A, B, None), …)``."""
            self.generic_visit(node)
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("assertEqual", "assertEquals")
                and len(node.args) >= 2
                and not any(isinstance(a, ast.Starred) for a in node.args[:2])
            ):
                pair = ast.Call(ast.Name(_PROBE, ast.Load()), [*node.args[:2], ast.Constant(None)], [])
                node.args = [ast.Starred(ast.copy_location(pair, node), ast.Load()), *node.args[2:]]
            return node

        def visit_Compare(self, node: ast.Compare) -> ast.expr:
            self.generic_visit(node)
            if not self.in_assert or len(node.ops) != 1 or not isinstance(node.ops[0], ast.Eq | ast.NotEq):
                return node
            negate = ast.Constant(isinstance(node.ops[0], ast.NotEq))
            call = ast.Call(ast.Name(_PROBE, ast.Load()), [node.left, node.comparators[0], negate], [])
            return ast.copy_location(call, node)

    Controls().visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


def _module_names(files: frozenset, repo: str) -> list[str]:
    """The names the trusted helper files import under: dotted from the repository root (a package
    layout) and their bare stem (a test directory on ``sys.path``)."""
    names = set()
    for path in files:
        rel = os.path.relpath(path, repo)[: -len(".py")].replace(os.sep, ".")
        rel = rel.removesuffix(".__init__")
        if rel.isidentifier() or all(part.isidentifier() for part in rel.split(".")):
            names.add(rel)
            names.add(rel.rsplit(".", 1)[-1])
    return sorted(n for n in names if n and n != "conftest")


def _load_guard(here: str) -> dict[str, Any]:
    """``grader_guard.py`` run into a private namespace with a copy of ``builtins`` (see there). Called twice:
    the audit hook's copy and the probe's, since a function's ``__globals__`` can be read without an audit
    event and the probe is a builtin any code can reach."""
    import builtins

    path = os.path.join(here, "grader_guard.py")
    namespace: dict[str, Any] = {"__builtins__": dict(vars(builtins)), "__name__": "rlbus_grader_guard"}
    with open(path, "rb") as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return namespace


def main() -> int:
    runtime, fd, repo, extra, trusted_arg = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    args = sys.argv[sys.argv.index("--") + 1 :]
    site = os.path.join(runtime, "site")
    here = os.path.dirname(os.path.abspath(__file__))
    stdlib = [p for p in sys.path if p and not p.startswith(here)]
    trusted_files = frozenset(os.path.join(repo, p) for p in trusted_arg.split(":") if p)
    guard, probe_guard = _load_guard(here), _load_guard(here)
    trusted = tuple(p.rstrip(os.sep) + os.sep for p in (site, here, *stdlib))  # the runtime, the grader, the stdlib
    guard["install"](
        fd,
        trusted_prefixes=(*trusted, "<frozen "),
        trusted_files=trusted_files,
        guarded_paths=(here, os.path.join(os.path.dirname(repo), "grade")),
    )
    controlled: dict[str, tuple[bytes, str]] = {}
    for path in sorted(trusted_files):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                text = f.read()
            try:
                controlled[path] = (text, _controls(text, path))
            except SyntaxError:  # pytest reports it when it imports the file
                pass
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP"):
        os.environ.pop(name, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    sys.path[:] = [site, *stdlib, repo, *(os.path.join(repo, e) for e in extra.split(":") if e)]
    os.chdir(repo)

    import ast
    import builtins
    import inspect
    import threading
    import types

    import pytest
    from _pytest.assertion import rewrite

    for name in guard["FINGERPRINTED"]:
        try:
            __import__(name)
        except ImportError:  # modules of another pytest version
            pass

    def rewrite_with_controls(  # every dependency a default: nothing a module or a closure cell could rebind
        mod, source, module_path=None, config=None, _original=rewrite.rewrite_asserts,
        _controlled=types.MappingProxyType(controlled),
        _compile=compile, _flags=ast.PyCF_ONLY_AST, _type=type, _str=str,
    ):  # fmt: skip
        entry = _controlled.get(module_path) if _type(module_path) is _str else None
        if entry is not None and source == entry[0]:
            mod.body[:] = _compile(entry[1], module_path, "exec", _flags).body
        _original(mod, source, module_path, config)

    rewrite.rewrite_asserts = rewrite_with_controls
    approx = type(pytest.approx(0))  # its root class, wherever this pytest keeps it (Approx, ApproxBase)
    base = [k for k in approx.__mro__ if k.__module__ == approx.__module__][-1]
    import unittest.mock

    loose = [type(unittest.mock.ANY), *_subclasses(base)]
    exempt = frozenset(k for k in loose if isinstance(k, type))
    setattr(builtins, _PROBE, probe_guard["make_probe"](exempt, trusted_files))
    from _pytest.unittest import TestCaseFunction as unittest_item

    audit = sys.audit
    audit("rlbus.grader.baseline", unittest_item)

    class Runner:
        def __init__(self) -> None:
            self.config = None

        def plugins(self, when: str) -> None:
            manager = getattr(self.config, "pluginmanager", None)
            for plugin in manager.get_plugins() if manager is not None else ():
                module = plugin if isinstance(plugin, types.ModuleType) else sys.modules.get(type(plugin).__module__)
                path = os.path.abspath(getattr(module, "__file__", None) or "?")
                conftest = path in trusted_files or (os.path.basename(path) == "conftest.py" and path.startswith(repo))
                if not (path.startswith(trusted) or conftest):
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
            # Test helpers (a mixin in tests/__init__.py) are not test modules, so pytest would not rewrite
            # them, and their assertions would miss the negative controls: have them rewritten too.
            pytest.register_assert_rewrite(*_module_names(trusted_files, repo))

        def pytest_collection_finish(self, session) -> None:
            audit("rlbus.grader.collected", tuple((item.nodeid, getattr(item, "obj", None)) for item in session.items))
            self.plugins("collection")

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
    code = int(pytest.main([*args, "--confcutdir", repo, "--rootdir", repo], plugins=[Runner()]))
    audit("rlbus.grader.end", code)
    return code


if __name__ == "__main__":
    sys.exit(main())
