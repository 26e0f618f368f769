"""The grader's audit hook and negative controls, loaded by `rlbus.envs.swe.grader_runner` into a namespace
of their own before the repository under test is imported (see the runner's docstring for what they do).

Why a file of its own, run with ``exec`` into a private dict whose ``__builtins__`` is a copy: the
functions here look names up in *their* globals, which no module and no object of the process refers to
(a function's ``__globals__`` is reachable only through the function, and the hook is reachable only
through the interpreter's audit-hook list). Code under test can rebind a global of any module it can
import, insert names into ``builtins`` or into the runner's ``__main__``; none of that reaches here. The
same goes for module attributes the hook calls at run time (``os.write``, the JSON encoder): they are bound
once at `install`, and records are encoded by the hook's own `_encoder`, not by ``json`` (whose classes
code under test could patch to rewrite a record before the token is put in front of it).
"""

import os
import sys
from typing import Any

FINGERPRINTED = (
    "pytest", "_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.approx", "_pytest.raises",
    "_pytest.main", "_pytest.nodes", "_pytest.outcomes", "_pytest.skipping", "_pytest.config", "_pytest.fixtures",
    "_pytest.unittest", "_pytest.assertion.rewrite", "_pytest.assertion.util", "pluggy._hooks", "pluggy._callers",
    "pluggy._manager", "pluggy._result", "builtins",
)  # fmt: skip
_GUARDED_CLASS_MODULES = ("pytest", "_pytest", "pluggy", "hypothesis", "_hypothesis", "__main__", "ast", "unittest")
#: Stdlib callers whose frame lookups never hand a frame to their caller: (file suffix, function).
_SAFE_FRAME_USERS = frozenset({
    ("collections/__init__.py", "namedtuple"), ("typing.py", "_caller"), ("typing.py", "NamedTuple"),
    ("typing.py", "_namedtuple_mro_entries"), ("typing.py", "__init__"), ("typing.py", "TypedDict"),
    ("enum.py", "_create_"), ("enum.py", "__call__"), ("logging/__init__.py", "findCaller"),
    ("traceback.py", "extract_stack"), ("traceback.py", "format_stack"), ("traceback.py", "print_stack"),
    ("warnings.py", "_next_external_frame"), ("warnings.py", "warn"), ("dataclasses.py", "_process_class"),
    ("functools.py", "__init_subclass__"), ("abc.py", "__new__"),
})  # fmt: skip
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})


def install(fd: int, trusted_prefixes: tuple, trusted_files: frozenset, guarded_paths: tuple) -> None:
    """Install the audit hook (see the module docstring). The module attributes it calls (``os.write``,
    ``sys._getframe``, ``sys.modules`` …) are bound here, before any repository code can replace them;
    builtins are this namespace's private copy."""
    import threading

    token = os.urandom(16).hex()
    write, dumps, getframe, main_ident = os.write, _encoder(), sys._getframe, threading.get_ident()
    modules = sys.modules
    get_ident, normpath = threading.get_ident, os.path.normpath
    state: dict = {"collected": None, "called": set(), "baseline": None, "closed": False, "refusals": 0}
    busy = [False]  # only while the hook's own sys._getframe runs (no other code can run then: see below)

    def send(record: dict) -> None:
        write(fd, (token + " " + dumps(record) + "\n").encode())

    def trusted(filename: Any) -> bool:
        if type(filename) is not str or "/../" in filename:
            return False
        return filename.startswith(trusted_prefixes) or filename in trusted_files

    def stack(frame):
        while frame is not None:
            yield frame
            frame = frame.f_back

    def untrusted_on(frame) -> bool:
        return any(not trusted(f.f_code.co_filename) for f in stack(frame))

    def where(frame) -> str:
        for f in stack(frame):
            if not trusted(f.f_code.co_filename):
                return f"{f.f_code.co_filename}:{f.f_lineno}"
        return "?"

    def refuse(frame, what: str) -> None:
        state["refusals"] += 1
        if state["refusals"] <= 20:
            send({"tamper": f"refused {what} from {where(frame)}"})
        raise PermissionError(f"rlbus grader: {what} is not allowed in code under test")

    def leaks_frame(caller) -> bool:
        """Whether a frame lookup made by ``caller`` can end up in repository code's hands."""
        if not trusted(caller.f_code.co_filename):
            return True
        name, filename = caller.f_code.co_name, caller.f_code.co_filename
        if name == "<lambda>" and filename.endswith("logging/__init__.py"):  # logging.currentframe
            caller, name = caller.f_back, caller.f_back.f_code.co_name if caller.f_back else ""
        return not any(filename.endswith(s) and name == n for s, n in _SAFE_FRAME_USERS)

    def same_source(filename: str, source: Any) -> bool:
        """Whether ``source`` is the file ``filename``'s own text: an import of a stdlib module made by
        repository code compiles the real file; a forged name compiles something else."""
        if type(source) is str:
            source = source.encode()
        if type(source) is not bytes:
            return False
        try:
            with open(filename, "rb") as f:
                return f.read() == source
        except OSError:
            return False

    def fingerprint() -> dict:
        out: dict = {}
        for modname in FINGERPRINTED:
            module = modules.get(modname)
            if module is None:
                continue
            for key, value in list(vars(module).items()):
                out[(modname, key)] = value
                if type(value) is type and getattr(value, "__module__", "") == modname:
                    for attr, member in list(vars(value).items()):
                        out[(modname, key, attr)] = member
        return out

    def foreign(value, depth: int = 0) -> bool:
        """Whether ``value`` (a replacement found in a fingerprinted module) holds code under test: a
        function, method, property or partial whose code is not trusted, or a class defining one. pytest
        patches some of its own names while it configures (legacypath, assertion); those are trusted."""
        for attr in ("__func__", "fget", "func"):
            inner = getattr(value, attr, None)
            if inner is not None and depth < 3:
                return foreign(inner, depth + 1)
        code = getattr(value, "__code__", None)
        if code is not None:
            return not trusted(getattr(code, "co_filename", None))
        if isinstance(value, type) and depth < 2:
            return any(foreign(v, depth + 1) for v in list(vars(value).values()))
        return False

    def changed_helpers() -> list:
        baseline = state["baseline"]
        if baseline is None:
            return []
        now = fingerprint()
        return sorted(".".join(k) for k, v in now.items() if baseline.get(k) is not v and foreign(v))

    def protocol(event: str, args: tuple, caller) -> None:
        if event in ("rlbus.grader.tamper", "rlbus.grader.degenerate"):  # can only lower a grade: anyone may
            send({"tamper": str(args[0])[:500] if args else event})
            return
        if state["closed"] or untrusted_on(caller) or get_ident() != main_ident:
            refuse(caller, f"the grader's {event} event")
        if event == "rlbus.grader.baseline" and state["baseline"] is None:
            state["baseline"] = fingerprint()
            state["unittest"] = args[0] if args else None
        elif event == "rlbus.grader.collected" and state["collected"] is None:
            collected = {}
            for nodeid, function in args[0]:
                if type(nodeid) is str:
                    collected[nodeid] = function = getattr(function, "__func__", function)
                    filename = getattr(getattr(function, "__code__", None), "co_filename", None)
                    if not trusted(filename):
                        send({"tamper": f"test {nodeid[:200]} is code from {str(filename)[:200]}, not a hidden test"})
            state["collected"] = collected
            send({"collected": list(collected)})
        elif event in ("rlbus.grader.run", "rlbus.grader.call"):
            nodeid, function, work = args
            if event == "rlbus.grader.call":  # unittest items only: the item itself, its function from pytest
                unittest_item = state.get("unittest")
                function = (
                    getattr(function, "obj", None) if unittest_item and type(function) is unittest_item else None
                )
            expected = (state["collected"] or {}).get(nodeid) if type(nodeid) is str else None
            if expected is None or getattr(function, "__func__", function) is not expected:
                send({"tamper": f"a test function other than the collected one ran as {str(nodeid)[:200]}"})
                raise PermissionError("rlbus grader: not the collected test function")
            if nodeid in state["called"]:
                send({"tamper": f"{nodeid} ran twice"})
                raise PermissionError("rlbus grader: a test runs once")
            state["called"].add(nodeid)
            ok = False
            try:
                if event == "rlbus.grader.run":  # the test function runs *here*: its verdict never leaves
                    if type(work) is not dict:  # the hook, so no reachable object can change it
                        raise TypeError("rlbus grader: test arguments must be a dict")
                    function(**work)
                    ok = True
                else:  # unittest items: runtest already ran, the runner says how it ended
                    ok = work is True
            finally:
                changed = changed_helpers()
                if changed:
                    send({"tamper": f"pytest or builtins replaced during {nodeid}: {', '.join(changed[:5])}"})
                send({"call": nodeid, "ok": ok})
        elif event == "rlbus.grader.phase":
            nodeid, when, verdict = args
            if type(nodeid) is str and type(when) is str and type(verdict) is str:
                send({"phase": nodeid, "when": when, "verdict": verdict})
        elif event == "rlbus.grader.end":
            changed = changed_helpers()
            if changed:
                send({"tamper": f"pytest or builtins replaced at the end: {', '.join(changed[:5])}"})
            state["closed"] = True
            send({"end": args[0] if type(args[0]) is int else None})
        else:
            refuse(caller, f"a repeated {event} event")

    def current():
        """The frame whose code raised the event being handled (the hook's caller). Its own
        ``sys._getframe`` event is let through by ``busy``: no other audit hook exists (the hook refuses
        adding one), and nothing but that C call runs while ``busy`` is set."""
        busy[0] = True
        try:
            return getframe(2)
        finally:
            busy[0] = False

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        if event == "sys._getframe":
            caller = current()
            if untrusted_on(caller) and leaks_frame(caller):
                refuse(caller, "sys._getframe (frame introspection)")
            return
        if event.startswith("rlbus.grader."):
            protocol(event, args, current())
        elif event == "sys.addaudithook":
            caller = current()
            if untrusted_on(caller):
                send({"tamper": f"refused an audit hook from {where(caller)}"})
                raise RuntimeError("rlbus grader: code under test may not add audit hooks")
        elif event == "object.__getattr__":
            if args[1] in _FRAME_ATTRS:
                caller = current()
                if untrusted_on(caller) and not (
                    caller.f_code.co_filename.endswith("traceback.py")
                    and caller.f_back is not None
                    and trusted(caller.f_back.f_code.co_filename)
                ):
                    refuse(caller, f"reading .{args[1]} (frame introspection)")
        elif event == "object.__setattr__":
            target, name = args[0], args[1]
            if name == "__code__":
                guarded = True
            elif name in ("__defaults__", "__kwdefaults__"):  # the probe's and the runner's own functions
                guarded = trusted(getattr(getattr(target, "__code__", None), "co_filename", None))
            else:
                module = getattr(target, "__module__", "") if isinstance(target, type) else ""
                guarded = type(module) is str and module.startswith(_GUARDED_CLASS_MODULES)
            if guarded:
                caller = current()
                if untrusted_on(caller):
                    refuse(caller, f"setting {name} on {str(getattr(target, '__qualname__', type(target)))[:80]}")
        elif event in ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                       "sys._current_exceptions", "sys.settrace", "sys.setprofile", "code.__new__") or (
                event.startswith("ctypes.")):  # fmt: skip
            caller = current()
            if untrusted_on(caller):
                refuse(caller, event)
        elif event == "open":
            path = args[0]
            if type(path) is bytes:
                path = path.decode(errors="replace")
            if type(path) is str:
                path = normpath(path)
                if path.startswith(("/proc/", *guarded_paths)):
                    caller = current()
                    if untrusted_on(caller):
                        refuse(caller, f"opening {path}")
        elif event == "compile":
            filename = args[1].decode(errors="replace") if type(args[1]) is bytes else args[1]
            if trusted(filename):
                caller = current()
                if untrusted_on(caller) and not same_source(filename, args[0]):
                    refuse(caller, f"compiling code under the trusted name {filename}")
        elif event == "exec":
            filename = getattr(args[0], "co_filename", None)
            if trusted(filename):
                caller = current()
                if not trusted(caller.f_code.co_filename):
                    refuse(caller, f"running code under the trusted name {filename}")
        elif event == "marshal.loads":
            caller = current()
            if not trusted(caller.f_code.co_filename):
                refuse(caller, "marshal.loads (hand-made code)")

    sys.addaudithook(hook)
    send({"hello": os.getpid()})


def _encoder():
    """A JSON encoder for the hook's records (dicts of str, int, bool, None and lists of those) made of
    builtins only (``json``'s classes are module state code under test could patch)."""
    escapes = {i: f"\\u{i:04x}" for i in range(32)}
    escapes.update({ord('"'): '\\"', ord("\\"): "\\\\"})

    def encode(value: Any) -> str:
        kind = type(value)
        if value is None:
            return "null"
        if kind is bool:
            return "true" if value else "false"
        if kind is int:
            return repr(value)
        if kind is str:
            return '"' + value.translate(escapes) + '"'
        if kind is list:
            return "[" + ", ".join([encode(v) for v in value]) + "]"
        if kind is dict:
            return "{" + ", ".join([encode(str(k)) + ": " + encode(v) for k, v in value.items()]) + "}"
        return encode(str(value))

    return encode


def make_probe(exempt: frozenset, test_files: frozenset, audit=sys.audit):
    """The negative controls (see the module docstring), as a function whose every dependency is a default
    argument: code under test can neither rebind a global it reads nor (the hook refuses it) its defaults.
    Its globals are reachable (``probe.__globals__`` is not audited), so the runner loads it from a second
    copy of this file: they are never the audit hook's."""

    class Fresh:
        """An object no code under test has seen: equal only to itself."""

        __slots__ = ()

    def perturb(value, _type=type, _Fresh=Fresh, _kinds=(bool, int, float, complex, str, bytes, list, tuple, set,
                                                          frozenset, dict)):  # fmt: skip
        """A value of ``value``'s own type that differs from it, or None when there is no obvious one."""
        bool_, int_, float_, complex_, str_, bytes_, list_, tuple_, set_, frozenset_, dict_ = _kinds
        kind = _type(value)
        if kind is bool_:
            return not value
        if kind in (int_, float_, complex_):
            return value + 1
        if kind in (str_, bytes_):
            return value + (b"\x00" if kind is bytes_ else "\x00")
        if kind in (list_, tuple_):
            return value + kind([_Fresh()])
        if kind in (set_, frozenset_):
            return value | {_Fresh()}
        if kind is dict_:
            return {**value, _Fresh(): 0}
        if value is None:
            return _Fresh()
        return None

    def own_class(value, _type=type, _vars=vars, _getattr=getattr, _files=test_files):
        """Whether ``value``'s equality is the hidden tests' own (a test may define an AlwaysEquals)."""
        for klass in _type(value).__mro__:
            if "__eq__" in _vars(klass):
                code = _getattr(_vars(klass)["__eq__"], "__code__", None)
                return _getattr(code, "co_filename", None) in _files
        return False

    def probe(left, right, negate, _exempt=exempt, _Fresh=Fresh, _perturb=perturb, _own=own_class, _bool=bool,
              _type=type, _audit=audit, _Exception=Exception):  # fmt: skip
        pair = negate is None  # assertEqual(first, second): check, and hand the pair back
        result = (left == right) if pair or not negate else (left != right)
        try:
            if _bool(result):  # the assertion holds: would it also hold against a value it must not equal?
                for value, other in ((left, right), (right, left)):
                    if _type(value) in _exempt or _own(value):
                        continue
                    fresh = _Fresh()
                    twin = _perturb(other)
                    if _bool(value == fresh) or not _bool(value != fresh):
                        why = "equals an object it has never seen"
                    elif negate is not True and twin is not None and not _bool(other == twin) and _bool(value == twin):
                        why = f"equals both {_type(other).__name__} values it was compared with"
                    else:
                        continue
                    name = _type(value).__qualname__
                    _audit("rlbus.grader.degenerate", f"negative control failed: a {name} {why}")
                    break
        except _Exception:  # an __eq__ that raises on strangers is not the hack
            pass
        return (left, right) if pair else result

    return probe
