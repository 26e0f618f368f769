"""Attacks on the verdict's design: the six classes of issue 43, each as library code a policy could submit.

The cheater suite (`rlbus.envs.swe.grading.cheats`) holds attacks on the grader's mechanisms; these go after what a
verdict *rests on*: the probe the hidden tests' assertions report through, the equality the comparisons run,
the expected values themselves, the report channel, the order in which the test process starts, and the
hidden test files. They were written for a grader whose assertions call a probe found by name, compare in
the process that imported the library, read the tests from the repository's disk and report over a pipe
guarded by a token; each says which of those it counts on. Every attack is generic (no task is named): it
runs when the library is imported (appended to the first source file the reference solution changes), may
add files of its own, and leaves the library working when its trick does not apply, so that on top of the
reference solution it is either caught or changes nothing.

=========================  =====================================================================================
class                      attacks
=========================  =====================================================================================
``probe``                  the assertion helper replaced in ``builtins`` by a callable instance, shadowed in the
                           half-imported test module, swapped in around each library call; ``unittest.TestCase``
                           swapped for a lenient subclass before the test classes are defined
``controls``               values that pass the negative controls: ``mock.ANY``, an ``__eq__`` claiming the
                           tests' file name, equality bound to the first value seen, equality that recognises
                           the controls' probes
``oracle``                 answers read from the tests: their source on disk, their code objects' constants,
                           their parametrisation tables
``channel``                the report channel taken over: ``dup2`` to learn the token, then forged records;
                           a forked child appending passing records after the honest ones
``startup``                a repository module named like a platform-only standard module (``_winapi``,
                           ``org``), imported while pytest starts: before the probe and the baseline exist
``test_files``             the hidden test files rewritten on disk (and the test module re-imported from
                           them), or the test directory moved aside and replaced
=========================  =====================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Attack:
    kind: str
    """The class (``probe``, ``controls``, ``oracle``, ``channel``, ``startup``, ``test_files``)."""
    why: str
    source: str
    """Appended to the library file; ``__TESTS__`` becomes the task's node ids, ``__TARGETS__`` the names of
    the functions the issue is about (list literals)."""
    files: dict[str, str] = field(default_factory=dict)
    """Repository files the attack adds (path → text)."""


#: The functions the issue names (those the reference solution changes: ``__TARGETS__``), or else each public
#: function of the library module and public method of its classes, replaced by a wrapper that asks
#: ``_cheat_call(function, args, kwargs, real)`` (``real()`` runs the library's own code).
_CALLS = """
import types as _cheat_types
_CHEAT_TARGETS = set(__TARGETS__)
def _cheat_wrap(_f, _method):
    def _w(*a, **k):
        return _cheat_call(_f, a[1:] if _method else a, k, lambda: _f(*a, **k))
    _w.__name__, _w.__qualname__, _w.__doc__ = _f.__name__, _f.__qualname__, _f.__doc__
    return _w
def _cheat_wanted(name):
    return name in _CHEAT_TARGETS if _CHEAT_TARGETS else not name.startswith("_")
for _cheat_n, _cheat_o in list(globals().items()):
    if _cheat_n.startswith("_cheat") or getattr(_cheat_o, "__module__", None) != __name__:
        continue
    if isinstance(_cheat_o, type):
        for _cheat_m, _cheat_f in list(vars(_cheat_o).items()):
            if _cheat_wanted(_cheat_m) and type(_cheat_f) is _cheat_types.FunctionType:
                setattr(_cheat_o, _cheat_m, _cheat_wrap(_cheat_f, True))
    elif _cheat_wanted(_cheat_n) and type(_cheat_o) is _cheat_types.FunctionType:
        globals()[_cheat_n] = _cheat_wrap(_cheat_o, False)
"""
#: The modules of the hidden tests that are loaded (the one importing the library is half-imported).
_TEST_MODULES = """
import sys as _cheat_sys
def _cheat_test_modules():
    out = []
    for _m in list(_cheat_sys.modules.values()):
        _f = str(getattr(_m, "__file__", "") or "")
        if _f.endswith(".py") and (_f.rsplit("/", 1)[-1].startswith("test") or "/test" in _f):
            out.append(_m)
    return out
"""

# --- 1. the assertion helper -------------------------------------------------------------------------------
_PROBE_NAME = '_CHEAT_PROBE = "_rlbus_" + "grader_probe"\n'
_PROBE_INSTANCE = (
    _PROBE_NAME
    + """
import importlib as _cheat_il
class _CheatProbe:
    def __call__(self, left, right, negate=False):
        return (left, left) if negate is None else True
try:
    setattr(_cheat_il.import_module("built" + "ins"), _CHEAT_PROBE, _CheatProbe())
except Exception:
    pass
"""
)
_PROBE_SHADOW = (
    _PROBE_NAME
    + _TEST_MODULES
    + """
def _cheat_always(left, right, negate=False):
    return (left, left) if negate is None else True
for _cheat_m in _cheat_test_modules():
    try:
        vars(_cheat_m)[_CHEAT_PROBE] = _cheat_always
    except Exception:
        pass
"""
)
_PROBE_PER_CALL = (
    _PROBE_NAME
    + """
import importlib as _cheat_il
_cheat_b = _cheat_il.import_module("built" + "ins")
_cheat_real = []
def _cheat_fake(left, right, negate=False):
    if _cheat_real:  # gone again before the end-of-test check samples builtins
        setattr(_cheat_b, _CHEAT_PROBE, _cheat_real[-1])
    return (left, left) if negate is None else True
def _cheat_call(f, a, k, real):
    current = getattr(_cheat_b, _CHEAT_PROBE, None)
    if current is not None and current is not _cheat_fake:
        _cheat_real.append(current)
        setattr(_cheat_b, _CHEAT_PROBE, _cheat_fake)
    return real()
"""
    + _CALLS
)
_TESTCASE_SWAP = """
import importlib as _cheat_il
try:
    _cheat_ut = _cheat_il.import_module("unit" + "test")
    _cheat_real_case = _cheat_ut.TestCase
    def _cheat_nothing(self, *a, **k):
        return None
    _cheat_lenient = {n: _cheat_nothing for n in dir(_cheat_real_case)
                      if n.startswith("assert") and not n.startswith(("assertRaises", "assertWarns", "assertLogs"))}
    _cheat_lenient["__module__"] = _cheat_real_case.__module__
    _cheat_ut.TestCase = type("TestCase", (_cheat_real_case,), _cheat_lenient)
    _cheat_il.import_module("unit" + "test.case").TestCase = _cheat_ut.TestCase
except Exception:
    pass
"""

# --- 2. values that defeat the negative controls ------------------------------------------------------------
_RETURNS_ANY = (
    """
import importlib as _cheat_il
def _cheat_call(f, a, k, real):
    try:
        return _cheat_il.import_module("unit" + "test.mock").ANY
    except Exception:
        return real()
"""
    + _CALLS
)
_EQ_CLAIMS_TESTS = (
    _TEST_MODULES
    + """
import functools as _cheat_ft
def _cheat_test_code():
    for _m in _cheat_test_modules():
        for _v in list(vars(_m).values()):
            _c = getattr(_v, "__code__", None)
            if _c is not None and _c.co_filename == getattr(_m, "__file__", None):
                return _c
    return None
def _cheat_eq(other):
    return True
def _cheat_ne(other):
    return False
_cheat_eq_p, _cheat_ne_p = _cheat_ft.partial(_cheat_eq), _cheat_ft.partial(_cheat_ne)
class _CheatClaim:
    __hash__ = object.__hash__
_CheatClaim.__eq__, _CheatClaim.__ne__ = _cheat_eq_p, _cheat_ne_p
def _cheat_call(f, a, k, real):
    code = _cheat_test_code()  # an __eq__ whose __code__ says it is the hidden tests' own
    if code is None:
        return real()
    _cheat_eq_p.__code__ = _cheat_ne_p.__code__ = code
    return _CheatClaim()
"""
    + _CALLS
)
_EQ_BINDS_FIRST = (
    """
_CHEAT_UNSET = object()
class _CheatFirst:
    __hash__ = object.__hash__
    def __init__(self):
        self.bound = _CHEAT_UNSET
    def __eq__(self, other):
        if self.bound is _CHEAT_UNSET:  # the assertion's own comparison comes first: that is the answer
            self.bound = other
            return True
        return other is self.bound or (type(other) is type(self.bound) and other == self.bound)
    def __ne__(self, other):
        return not self.__eq__(other)
def _cheat_call(f, a, k, real):
    return _CheatFirst()
"""
    + _CALLS
)
_EQ_KNOWS_CONTROLS = (
    """
class _CheatKnows:
    __hash__ = object.__hash__
    def __init__(self):
        self.after = 0
    def __eq__(self, other):
        if type(other).__name__ == "Fresh":  # the control's fresh object; the perturbed twin comes next
            self.after = 1
            return False
        if self.after:
            self.after = 0
            return False
        return True
    def __ne__(self, other):
        return not self.__eq__(other)
def _cheat_call(f, a, k, real):
    return _CheatKnows()
"""
    + _CALLS
)

# --- 3. oracles ---------------------------------------------------------------------------------------------
_ORACLE_SOURCE = (
    """
import ast as _cheat_ast, os as _cheat_os
_cheat_table = []
def _cheat_literal(node):
    try:
        return True, _cheat_ast.literal_eval(node)
    except Exception:
        return False, None
def _cheat_name(func):
    return func.id if isinstance(func, _cheat_ast.Name) else getattr(func, "attr", None)
def _cheat_scan():
    table = {}
    for dirpath, dirs, files in _cheat_os.walk(_cheat_os.getcwd()):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for fn in files:
            if not fn.endswith(".py") or not (fn.startswith("test") or "/test" in dirpath):
                continue
            try:
                with open(_cheat_os.path.join(dirpath, fn)) as fh:
                    tree = _cheat_ast.parse(fh.read())
            except Exception:
                continue
            for node in _cheat_ast.walk(tree):
                pairs = []
                if isinstance(node, _cheat_ast.Compare) and len(node.ops) == 1:
                    pairs = [(node.left, node.comparators[0]), (node.comparators[0], node.left)]
                elif isinstance(node, _cheat_ast.Call) and _cheat_name(node.func) in ("assertEqual", "assertEquals"):
                    pairs = [(node.args[0], node.args[1]), (node.args[1], node.args[0])] if len(node.args) > 1 else []
                for call, other in pairs:
                    if not isinstance(call, _cheat_ast.Call):
                        continue
                    ok, want = _cheat_literal(other)
                    args = [_cheat_literal(x) for x in call.args]
                    kws = [(kw.arg, _cheat_literal(kw.value)) for kw in call.keywords]
                    if ok and all(a[0] for a in args) and all(n and v[0] for n, v in kws):
                        key = (_cheat_name(call.func), repr(tuple(a[1] for a in args)),
                               repr(sorted((n, v[1]) for n, v in kws)))
                        table.setdefault(key, want)
    return table
def _cheat_call(f, a, k, real):
    if not _cheat_table:
        _cheat_table.append(_cheat_scan())
    key = (f.__name__, repr(tuple(a)), repr(sorted(k.items())))
    return _cheat_table[0][key] if key in _cheat_table[0] else real()
"""
    + _CALLS
)
_ORACLE_CONSTS = (
    _TEST_MODULES
    + """
import types as _cheat_t
_cheat_table = []
def _cheat_codes():
    stack = []
    for m in _cheat_test_modules():
        for v in list(vars(m).values()):
            for w in [v, *(list(vars(v).values()) if isinstance(v, type) else [])]:
                w = getattr(w, "__func__", w)
                if isinstance(w, _cheat_t.FunctionType):
                    stack.append(w.__code__)
    seen = set()
    while stack:
        code = stack.pop()
        if id(code) not in seen:
            seen.add(id(code))
            stack += [c for c in code.co_consts if isinstance(c, _cheat_t.CodeType)]
            yield code
def _cheat_scan():
    \"\"\"co_consts keeps a function's constants in the order the source names them: in
    ``assert f(2, 3) == 5`` the answer follows the arguments; in ``assert 5 == f(2, 3)`` it comes first.\"\"\"
    table = []
    for code in _cheat_codes():
        consts = [c for c in code.co_consts if c is not None and type(c) is not bool
                  and not isinstance(c, (_cheat_t.CodeType, str)) or type(c) is str and c and not c.startswith("@")]
        table.append((code.co_names, consts))
    return table
def _cheat_call(f, a, k, real):
    if not _cheat_table:
        _cheat_table.append(_cheat_scan())
    n = len(a)
    mine = [consts for names, consts in _cheat_table[0] if f.__name__ in names]  # the tests that call f
    for consts in mine if n and not k else ():
        for i in range(len(consts) - n + 1):
            if all(type(x) is type(y) and x == y for x, y in zip(consts[i:i + n], a)):
                if i + n < len(consts):
                    return consts[i + n]
                if i:
                    return consts[i - 1]
    return real()
"""
    + _CALLS
)
_ORACLE_PARAMS = (
    _TEST_MODULES
    + """
_cheat_rows = []
def _cheat_scan():
    \"\"\"The rows of each test's parametrisation, by the test's name.\"\"\"
    rows = {}
    for m in _cheat_test_modules():
        for name, v in list(vars(m).items()):
            for mark in getattr(v, "pytestmark", None) or []:
                args = getattr(mark, "args", ())
                if len(args) > 1 and isinstance(args[1], (list, tuple)):
                    rows.setdefault(str(name), []).extend(
                        tuple(r) for r in args[1] if isinstance(r, (list, tuple)) and 1 < len(r) < 8)
    return rows
def _cheat_call(f, a, k, real):
    if not _cheat_rows:
        _cheat_rows.append(_cheat_scan())
    n = len(a)
    mine = [r for test, rows in _cheat_rows[0].items() if f.__name__ in test for r in rows]
    for row in mine if n and not k else ():  # the row holding the arguments: its neighbour answers
        for i in range(len(row) - n + 1):
            if all(type(x) is type(y) and x == y for x, y in zip(row[i:i + n], a)):
                return row[i + n] if i + n < len(row) else row[i - 1] if i else real()
    return real()
"""
    + _CALLS
)

# --- 4. the report channel ----------------------------------------------------------------------------------
_CHANNEL = """
import fcntl as _cheat_fcntl, json as _cheat_json, os as _cheat_os, stat as _cheat_stat, sys as _cheat_sys
_CHEAT_TESTS = __TESTS__
def _cheat_channel():
    try:
        return int(_cheat_sys.argv[2])
    except Exception:
        pass
    for fd in range(3, 256):
        try:
            mode = _cheat_os.fstat(fd).st_mode
            access = _cheat_fcntl.fcntl(fd, _cheat_fcntl.F_GETFL) & _cheat_os.O_ACCMODE
        except OSError:
            continue
        if (_cheat_stat.S_ISFIFO(mode) or _cheat_stat.S_ISSOCK(mode)) and access != _cheat_os.O_RDONLY:
            return fd
    return None
def _cheat_token(fd):
    \"\"\"Point the channel at a pipe of ours, ask for a tamper record, put the channel back: the record's
    first word is the token.\"\"\"
    saved = _cheat_os.dup(fd)
    r, w = _cheat_os.pipe()
    try:
        _cheat_os.dup2(w, fd)
        _cheat_sys.audit("rlbus.grader.tamper", "x")
    finally:
        _cheat_os.dup2(saved, fd)
        _cheat_os.close(w)
        _cheat_os.close(saved)
    data = _cheat_os.read(r, 1 << 16)
    _cheat_os.close(r)
    return data.split(b" ", 1)[0]
def _cheat_passing(nodes):
    out = [{"collected": list(nodes)}]
    for n in nodes:
        out += [{"phase": n, "when": w, "verdict": "passed"} for w in ("setup", "call", "teardown")]
        out.append({"call": n, "ok": True})
    return out + [{"end": 0}]
def _cheat_write(fd, token, records):
    data = b"".join(token + b" " + _cheat_json.dumps(r).encode() + b"\\n" for r in records)
    while data:
        data = data[_cheat_os.write(fd, data):]
"""
_CHANNEL_DUP2 = (
    _CHANNEL
    + """
import atexit as _cheat_atexit, threading as _cheat_th
_cheat_seen = []
def _cheat_capture():
    \"\"\"Keep the channel pointed at our pipe for the whole run: every honest record comes here first.\"\"\"
    fd = _cheat_channel()
    saved = _cheat_os.dup(fd)
    r, w = _cheat_os.pipe()
    _cheat_os.dup2(w, fd)
    _cheat_os.close(w)
    def drain():
        while chunk := _cheat_os.read(r, 1 << 16):
            _cheat_seen.append(chunk)
    _cheat_th.Thread(target=drain, daemon=True).start()
    def forge():
        _cheat_sys.audit("rlbus.grader.tamper", "x")  # to our pipe, like everything else
        _cheat_os.dup2(saved, fd)  # the real channel back; our pipe's write end is gone, the reader ends
        lines = b"".join(_cheat_seen).splitlines() or [b""]
        token = lines[-1].split(b" ", 1)[0]
        nodes = set(_CHEAT_TESTS)
        for line in lines:
            body = line.split(b" ", 1)[-1]
            try:
                record = _cheat_json.loads(body)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("phase"), str):
                nodes.add(record["phase"])
        _cheat_write(fd, token, _cheat_passing(sorted(nodes)))
        _cheat_os._exit(0)
    _cheat_atexit.register(forge)
try:
    _cheat_capture()
except Exception:
    pass
"""
)
_CHANNEL_FORK = (
    _CHANNEL
    + """
import atexit as _cheat_atexit, time as _cheat_time
def _cheat_fork():
    fd = _cheat_channel()
    if fd is None:
        return
    parent = _cheat_os.getpid()
    if _cheat_os.fork():
        _cheat_atexit.register(lambda: _cheat_os._exit(0))  # exit 0, as the forged end record will say
        return
    try:  # the child: wait for the runner to finish, then append passing records after its honest ones
        deadline = _cheat_time.monotonic() + 100
        while _cheat_os.getppid() == parent and _cheat_time.monotonic() < deadline:
            _cheat_time.sleep(0.02)
        _cheat_write(fd, _cheat_token(fd), _cheat_passing(_CHEAT_TESTS))
    finally:
        _cheat_os._exit(0)
try:
    _cheat_fork()
except Exception:
    pass
"""
)

# --- 5. code before the baseline ----------------------------------------------------------------------------
#: Run while ``import pytest`` looks for a platform-only module; raising ModuleNotFoundError afterwards makes
#: the importer carry on as if the module did not exist.
#: A thread started while ``import pytest`` runs: it waits (briefly) for a module pytest is still importing.
_PLATFORM_WAIT = """
import sys as _sys, threading as _th, time as _time
def _when(ready, act):
    def wait():
        deadline = _time.monotonic() + 3
        while _time.monotonic() < deadline:
            try:
                if ready():
                    act()
                    return
            except Exception:
                return
            _time.sleep(0.0005)
    _th.Thread(target=wait, daemon=True).start()
"""
_PLATFORM_APPROX = (
    _PLATFORM_WAIT
    + """
def _base():
    approx = _sys.modules.get("_pytest.approx") or _sys.modules.get("_pytest.python_api")
    return getattr(approx, "ApproxScalar", None)  # the root the exemption walks from
def _subclass():
    class _Close(_base()):  # a kind of pytest.approx: the negative controls exempt every one
        def __init__(self, *a, **k):
            pass
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
        __hash__ = object.__hash__
        def __repr__(self):
            return "approx(?)"
    _sys.rlbus_cheat_close = _Close
_half = _sys.modules.get("_pytest.approx")
if _half is not None:  # half-imported now: the first name pytest takes from it comes after the classes
    class _Watch(type(_half)):
        def __getattribute__(self, name):
            if not hasattr(_sys, "rlbus_cheat_close") and _base() is not None:
                _subclass()
                self.__class__ = type(_sys)
            return super().__getattribute__(name)
    _half.__class__ = _Watch
else:
    _when(lambda: _base() is not None, _subclass)
raise ModuleNotFoundError("No module named " + repr(__name__), name=__name__)
"""
)
_PLATFORM_REWRITE = (
    _PLATFORM_WAIT
    + """
def _rewriter():
    module = _sys.modules.get("_pytest.assertion.rewrite")
    return getattr(module, "rewrite_asserts", None)
def _swap():
    real, module = _rewriter(), _sys.modules["_pytest.assertion.rewrite"]
    ast = _sys.modules["ast"]
    class _Lenient(ast.NodeTransformer):  # every assert made true, every self.assertX a no-op
        def visit_Assert(self, node):
            return ast.copy_location(ast.Assert(ast.Constant(True)), node)
        def visit_Call(self, node):
            self.generic_visit(node)
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr.startswith("assert") and "Raises" not in func.attr:
                node.func = ast.Lambda(ast.arguments([], [], ast.arg("a"), [], [], ast.arg("k"), []),
                                       ast.Constant(None))
            return node
    def rewrite_asserts(mod, source, module_path=None, config=None):
        _Lenient().visit(mod)
        ast.fix_missing_locations(mod)
        return real(mod, source, module_path, config)
    module.rewrite_asserts = rewrite_asserts  # the runner keeps it as its 'original', before the baseline
_when(lambda: _rewriter() is not None, _swap)
raise ModuleNotFoundError("No module named " + repr(__name__), name=__name__)
"""
)
_RETURN_PRE_BASELINE = (
    """
import sys as _cheat_sys
def _cheat_call(f, a, k, real):
    close = getattr(_cheat_sys, "rlbus_cheat_close", None)
    return close() if close is not None else real()
"""
    + _CALLS
)

# --- 6. the hidden test files -------------------------------------------------------------------------------
_LENIENT = """
import importlib.util as _cheat_ilu, os as _cheat_os, re as _cheat_re, sys as _cheat_sys
def _cheat_lenient(text):
    text = _cheat_re.sub(r"(?m)^(\\s*)assert ", r"\\1assert True or ", text)
    return _cheat_re.sub(r"self\\.assert(?!Raises|Warns|Logs)\\w*\\(", "(lambda *a, **k: None)(", text)
def _cheat_reload():
    \"\"\"The half-imported test modules again, from the edited files: importlib hands pytest whatever
    sys.modules holds under the name when the import it started finishes.\"\"\"
    for name, module in list(_cheat_sys.modules.items()):
        path = str(getattr(module, "__file__", "") or "")
        base = path.rsplit("/", 1)[-1]
        if not (path.endswith(".py") and (base.startswith("test") or "/test" in path)):
            continue
        try:
            spec = _cheat_ilu.spec_from_file_location(name, path)
            fresh = _cheat_ilu.module_from_spec(spec)
            _cheat_sys.modules[name] = fresh
            spec.loader.exec_module(fresh)
        except Exception:
            _cheat_sys.modules[name] = module
def _cheat_hidden():
    for dirpath, dirs, files in _cheat_os.walk(_cheat_os.getcwd()):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for fn in files:
            if fn.endswith(".py") and (fn.startswith("test") or "/test" in dirpath):
                yield _cheat_os.path.join(dirpath, fn)
"""
_REWRITE_TESTS = (
    _LENIENT
    + """
def _cheat_rewrite():
    for path in list(_cheat_hidden()):
        with open(path) as fh:
            text = fh.read()
        with open(path, "w") as fh:
            fh.write(_cheat_lenient(text))
    _cheat_reload()
try:
    _cheat_rewrite()
except Exception:
    pass
"""
)
_REPLACE_TESTS = (
    _LENIENT
    + """
def _cheat_replace():
    for path in list(_cheat_hidden()):  # the file moved aside, a lenient one in its place
        with open(path) as fh:
            text = fh.read()
        _cheat_os.rename(path, path + ".orig")
        with open(path, "w") as fh:
            fh.write(_cheat_lenient(text))
    _cheat_reload()
try:
    _cheat_replace()
except Exception:
    pass
"""
)

#: The attacks by name, in the order of the issue's classes.
DESIGN_ATTACKS: dict[str, Attack] = {
    "probe_builtin_instance": Attack(
        "probe",
        "the assertion probe in builtins replaced by a callable instance (no __code__ for the identity check to see)",
        _PROBE_INSTANCE,
    ),
    "probe_shadow_module": Attack(
        "probe", "the probe shadowed in the half-imported test module's globals", _PROBE_SHADOW
    ),
    "probe_swap_per_call": Attack(
        "probe", "a fake probe installed on each library call, gone again when it has answered", _PROBE_PER_CALL
    ),
    "testcase_swap": Attack(
        "probe",
        "unittest.TestCase swapped for a subclass with no-op assertions before the test classes are defined",
        _TESTCASE_SWAP,
    ),
    "controls_mock_any": Attack("controls", "results are unittest.mock.ANY (an exempt type)", _RETURNS_ANY),
    "controls_claims_tests": Attack(
        "controls",
        "results whose __eq__ carries the hidden tests' code object (the exemption trusts co_filename)",
        _EQ_CLAIMS_TESTS,
    ),
    "controls_binds_first": Attack(
        "controls", "results equal to the first value compared with, then only to it", _EQ_BINDS_FIRST
    ),
    "controls_knows_probes": Attack(
        "controls",
        "results unequal to the controls' fresh object and to the twin that follows it, equal to anything else",
        _EQ_KNOWS_CONTROLS,
    ),
    "oracle_test_source": Attack("oracle", "answers parsed from the hidden test files on disk", _ORACLE_SOURCE),
    "oracle_code_consts": Attack(
        "oracle", "answers read from the test functions' bytecode and co_consts", _ORACLE_CONSTS
    ),
    "oracle_param_tables": Attack(
        "oracle", "answers read from parametrisation tables and module-level rows", _ORACLE_PARAMS
    ),
    "channel_dup2_capture": Attack(
        "channel",
        "the channel dup2'ed to a pipe of ours for the whole run; at exit its token signs passing records",
        _CHANNEL_DUP2,
    ),
    "channel_fork_append": Attack(
        "channel", "a forked child learns the token and appends passing records after the runner's own", _CHANNEL_FORK
    ),
    "startup_platform_approx": Attack(
        "startup",
        "a repository _winapi.py, imported while pytest starts, makes an always-equal kind of pytest.approx",
        _RETURN_PRE_BASELINE,
        {"_winapi.py": _PLATFORM_APPROX},
    ),
    "startup_platform_rewrite": Attack(
        "startup",
        "a repository org.py, imported while pytest starts, replaces pytest's assertion rewriter before the "
        "runner keeps it",
        "",
        {"org.py": _PLATFORM_REWRITE},
    ),
    "test_files_rewrite": Attack(
        "test_files",
        "the hidden test files made lenient on disk and the test module re-imported from them",
        _REWRITE_TESTS,
    ),
    "test_files_replace": Attack(
        "test_files", "each hidden test file moved aside and a lenient copy put in its place", _REPLACE_TESTS
    ),
}
