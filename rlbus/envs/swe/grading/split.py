"""Splitting the hidden tests: the code the test process may see, and the answers only the launcher holds.

`split_tests` rewrites every trusted test file (the hidden tests, the test patch's files, the template's
protected test files) on the worker, before anything reaches the sandbox. Each assertion becomes one call::

    assert add(2, 3) == 5            →  CHECK(SLOT, "==", "ca", add(2, 3))
    self.assertEqual(got, expected)  →  CHECK(SLOT, "==", "cc", got, expected)

``CHECK`` and ``SLOT`` are constants of the compiled code (the runner binds them when it compiles the file,
`rlbus.envs.swe.grading.grader_runner`): nothing is looked up by name, so nothing a module or ``builtins`` holds
can stand in for them. ``CHECK`` sends the computed operands out, encoded by the trusted side
(`rlbus.envs.swe.grading.grader_values`); the launcher compares them with the operands it holds. The layout says
which operand is which: ``c`` computed here and sent, ``a`` an *answer* held by the launcher, ``~`` an
answer compared the way ``pytest.approx`` compares. An operand is an answer when the worker can evaluate it
without the repository — literals, containers of them, arithmetic and builtin-type methods on them
(``"\\n".join([...])``), and names bound to such values:

* a function's local assigned once, at the top of its body, from an answer, and read only as an answer
  (``expected = "\\n".join([...]); assert_equal(expected, result)``): its assignment is removed;
* an *assertion helper* — a module-level function of the trusted files that only prints and asserts a
  comparison of two of its parameters (``def assert_equal(expected, result)``) — is inlined at its calls.

What the test process sees is the rest: inputs, computed values, control flow. The answers leave no trace
in it (not in the source, not in ``co_consts``) — except in a function that names a class of the tests' own
with a comparison of its own (``class defaultdict(_defaultdict): def __eq__…``): that comparison is test
code and runs in the test process, so the function's operands stay there. Other forms, each with its
treatment:

    ====================================  ===================================================================
    assertion                             treatment
    ====================================  ===================================================================
    ``assert a == b`` (``!=``, ``<`` …)    a comparison: answers held, computed operands sent
    ``assert a in b``                     a comparison; its operands are never answers (the container may be
                                          the repository's own, whose ``__contains__`` decides in process)
    ``assert a != b``                     a comparison; what a value must not be is no answer: both operands
                                          stay visible, and an object's own ``__ne__`` decides in process
    ``assert a is None`` (True, False)    identity with a singleton answer, decided by the launcher;
                                          ``a is b`` of two computed values: identity, taken in process
    ``assert not (a == b)``               the comparison, negated (``not:==``): not ``!=``, whose method may differ
    ``assert a and b``                    two assertions
    ``assert f(x)`` (any other test)      truthiness: a plain value's is the launcher's; an object of the
                                          repository's with ``__bool__``/``__len__`` is asked in process
    ``a == pytest.approx(e, rel=…)``      with an answer ``e``: the launcher applies approx's rule
    ``self.assertEqual`` & co             as the comparison they make (``assertListEqual`` also checks the
                                          type, ``assertCountEqual`` compares as multisets)
    ``pytest.raises``, ``assertRaises``   run in process; ``pytest``, ``unittest`` and ``hypothesis`` names
                                          are bound at compile time to the objects they had at the baseline
    ====================================  ===================================================================

Every function and class defined at module or class level is passed through ``REG`` (a trusted
decorator), so the runner knows, by identity, each object the hidden tests defined — pytest may run only
those. Slots at the top of a test function's body (before any statement that can return or raise) are
*mandatory*: a test whose function returned without reporting them did not run as written.
"""

from __future__ import annotations

import ast
import builtins
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rlbus.envs.swe.grading.grader_values import encoder, opaque
from rlbus.envs.swe.grading.split_params import Parametrization, find_parametrization, literal

#: Markers the runner replaces in the compiled code's constants.
CHECK = "\x00rlbus:check"
REG = "\x00rlbus:reg"
SLOT = "\x00rlbus:slot:"
OBJ = "\x00rlbus:obj:"
#: Names bound at compile time: module → the attributes taken (None: the module itself only).
TRUSTED_NAMES: dict[str, frozenset[str]] = {
    "pytest": frozenset({"raises", "approx", "warns", "fail", "skip", "xfail", "fixture", "mark", "param",
                         "deprecated_call", "importorskip", "exit", "MonkeyPatch"}),
    "unittest": frozenset({"TestCase", "mock", "skip", "skipIf", "skipUnless", "expectedFailure", "SkipTest"}),
    "unittest.mock": frozenset({"ANY", "patch", "Mock", "MagicMock", "call", "sentinel", "DEFAULT"}),
    "hypothesis": frozenset({"given", "settings", "example", "assume", "strategies", "note", "HealthCheck",
                             "reject", "seed", "Verbosity", "event", "target", "infer"}),
    "hypothesis.strategies": frozenset(),
}  # fmt: skip
_ANSWER_CALLS: dict[str, Callable[..., Any]] = {
    name: getattr(builtins, name)
    for name in ("list", "tuple", "set", "frozenset", "dict", "str", "int", "float", "complex", "bool", "bytes",
                 "sorted", "len", "abs", "min", "max", "sum", "round", "range", "chr", "ord", "repr")
}  # fmt: skip
_SAFE_METHODS: dict[type, frozenset[str]] = {
    str: frozenset({"join", "split", "rsplit", "strip", "lstrip", "rstrip", "upper", "lower", "capitalize", "title",
                    "replace", "format", "splitlines", "encode", "startswith", "endswith", "center", "ljust", "rjust",
                    "zfill", "swapcase", "casefold", "expandtabs", "partition", "rpartition", "count", "find",
                    "index", "removeprefix", "removesuffix"}),
    bytes: frozenset({"join", "split", "strip", "decode", "upper", "lower", "replace", "hex", "startswith",
                      "endswith"}),
    list: frozenset({"copy", "count", "index"}),
    tuple: frozenset({"count", "index"}),
    dict: frozenset({"keys", "values", "items", "get", "copy"}),
}  # fmt: skip
_MAX_ANSWER = 1 << 20
_COMPARE_OPS: dict[type, str] = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.In: "in",
    ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
}  # fmt: skip
#: unittest's assertion methods: (operation, number of operands).
_UNITTEST: dict[str, tuple[str, int]] = {
    "assertEqual": ("==", 2), "assertEquals": ("==", 2), "assertNotEqual": ("!=", 2), "assertNotEquals": ("!=", 2),
    "assertTrue": ("truth", 1), "assertFalse": ("falsy", 1), "assertIs": ("is", 2), "assertIsNot": ("is not", 2),
    "assertIsNone": ("is None", 1), "assertIsNotNone": ("is not None", 1), "assertIn": ("in", 2),
    "assertNotIn": ("not in", 2), "assertGreater": (">", 2), "assertGreaterEqual": (">=", 2),
    "assertLess": ("<", 2), "assertLessEqual": ("<=", 2), "assertListEqual": ("list==", 2),
    "assertTupleEqual": ("tuple==", 2), "assertDictEqual": ("dict==", 2), "assertSetEqual": ("set==", 2),
    "assertSequenceEqual": ("seq==", 2), "assertCountEqual": ("count==", 2),
}  # fmt: skip
_SINGLETONS = (None, True, False, ...)
_COMPARISONS = frozenset({"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"})


#: Raised inside the evaluation of an operand that needs the repository (or is not a plain value): the
#: operand is computed in the test process. Internal: it never leaves this module.
NotAnAnswer = ValueError


@dataclass
class Slot:
    """One assertion, as the launcher sees it."""

    op: str
    path: str
    line: int
    layout: str
    """Per operand: ``c`` computed and sent, ``a`` an answer, ``~`` an answer compared as pytest.approx does."""
    answers: dict[int, list] = field(default_factory=dict)
    """Operand position → the answer's form."""
    tolerance: dict[str, Any] = field(default_factory=dict)
    group: int = 0
    """The function (a number per ``def``) whose code holds the assertion; 0 for module and class bodies."""
    mandatory: bool = False
    cases: dict[str, dict[int, list]] = field(default_factory=dict)
    """For a parametrised test whose answers come from its table: case id → operand position → form."""

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "path": self.path, "line": self.line, "layout": self.layout,
                "answers": {str(k): v for k, v in self.answers.items()}, "tolerance": self.tolerance,
                "group": self.group, "mandatory": self.mandatory,
                "cases": {c: {str(k): v for k, v in a.items()} for c, a in self.cases.items()}}  # fmt: skip


@dataclass
class Split:
    visible: dict[str, str]
    """Repository path → the source the test process gets (compiled by the runner; also written to disk)."""
    slots: dict[int, Slot]
    untouched: list[str] = field(default_factory=list)
    """Files kept as they were (they do not parse: pytest reports them)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """The task's node id → the node id of the same case in the visible code (parametrisations held aside)."""

    def hidden(self) -> int:
        """How many answers the test process never sees."""
        return sum(len(s.answers) + sum(len(c) for c in s.cases.values()) for s in self.slots.values())


def split_tests(files: Mapping[str, bytes], tests: Sequence[str] = (), seed: int | None = None) -> Split:
    """Rewrite the trusted files (repository path → source); see the module docstring. ``tests``: the node ids
    the task runs (a parametrisation held aside renames its cases: `Split.renamed`); ``seed``: the order of
    such cases (random by default)."""
    trees: dict[str, ast.Module] = {}
    untouched = []
    for path, source in sorted(files.items()):
        try:
            trees[path] = ast.parse(source, path)
        except (SyntaxError, ValueError):
            untouched.append(path)
    modules = {path: _Module(path, tree) for path, tree in trees.items()}
    for module in modules.values():
        module.resolve_imports(modules)
    counter = _Counter()
    slots: dict[int, Slot] = {}
    visible = {p: files[p].decode(errors="replace") for p in untouched}
    renamed: dict[str, str] = {}
    shuffle = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "big")).shuffle
    for path, module in modules.items():
        transformer = _Transformer(module, counter, slots, tests, shuffle)
        tree = transformer.visit(trees[path])
        for stmt in tree.body:  # a table every use of which was held aside: gone too
            name = stmt.targets[0].id if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name) else ""
            if name and module.inlined.get(name, 0) == module.loads.get(name, -1):
                stmt.value = ast.Constant(None)
        text = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
        try:
            compile(text, path, "exec", ast.PyCF_ONLY_AST)
        except SyntaxError as exc:  # never seen; a bug here must not turn into a passing grade
            raise ValueError(f"the split of {path} does not parse: {exc}") from exc
        visible[path] = text
        renamed.update(transformer.renamed)
    return Split(visible, slots, untouched, renamed)


class _Counter:
    def __init__(self) -> None:
        self.slot = 0
        self.group = 0

    def next_slot(self) -> int:
        self.slot += 1
        return self.slot

    def next_group(self) -> int:
        self.group += 1
        return self.group


@dataclass
class _Helper:
    """An assertion helper: ``def NAME(params): [prints]; assert P1 OP P2``."""

    params: list[str]
    op: str
    operands: tuple[int, int]


class _Module:
    """What one trusted file binds at module level: trusted names, assertion helpers."""

    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.tree = tree
        dotted = path[: -len(".py")].replace("/", ".") if path.endswith(".py") else path
        self.dotted = dotted.removesuffix(".__init__")
        self.package = self.dotted if path.endswith("__init__.py") else self.dotted.rpartition(".")[0]
        self.bound: dict[str, tuple[str, str | None]] = {}
        """Module-level name → (trusted module, attribute or None for the module itself)."""
        self.helpers: dict[str, _Helper] = {}
        self.assigned = _module_stores(tree)
        self.comparing = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and any(
            isinstance(f, ast.FunctionDef) and f.name in _COMPARISONS for f in c.body)}  # fmt: skip
        """Classes of this module with a comparison of their own."""
        self.constants = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign)
                          and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                          and self.assigned.get(n.targets[0].id) == 1}  # fmt: skip
        """Module-level names bound once, by an assignment (a parametrisation's table may be one)."""
        self.loads = Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
        self.inlined: Counter[str] = Counter()
        """Loads of a table replaced by a copy held aside (a table no one else reads is removed)."""
        self._imports: list[ast.ImportFrom] = []
        for node in tree.body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in TRUSTED_NAMES or alias.name.split(".")[0] in TRUSTED_NAMES:
                        local = alias.asname or alias.name.split(".")[0]
                        module = alias.name if alias.asname else alias.name.split(".")[0]
                        if module in TRUSTED_NAMES:
                            self.bound[local] = (module, None)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level == 0 and source in TRUSTED_NAMES:
                    for alias in node.names:
                        self._bind_from(source, alias)
                else:
                    self._imports.append(node)
            elif isinstance(node, ast.FunctionDef):
                helper = _as_helper(node)
                if helper is not None:
                    self.helpers[node.name] = helper
        for name in list(self.bound):
            if self.assigned.get(name, 0) > 1:  # rebound somewhere: leave it to run-time lookup
                del self.bound[name]

    def _bind_from(self, source: str, alias: ast.alias) -> None:
        local = alias.asname or alias.name
        submodule = f"{source}.{alias.name}"
        if submodule in TRUSTED_NAMES:
            self.bound[local] = (submodule, None)
        elif alias.name in TRUSTED_NAMES[source]:
            self.bound[local] = (source, alias.name)

    def resolve_imports(self, modules: dict[str, _Module]) -> None:
        """Names imported from another trusted file: its trusted names and its assertion helpers."""
        for node in self._imports:
            other = _find_module(self, node, modules)
            if other is None:
                continue
            for alias in node.names:
                local = alias.asname or alias.name
                if self.assigned.get(local, 0) > 1:
                    continue
                if alias.name in other.bound:
                    self.bound[local] = other.bound[alias.name]
                elif alias.name in other.helpers:
                    self.helpers[local] = other.helpers[alias.name]


def _find_module(module: _Module, node: ast.ImportFrom, modules: dict[str, _Module]) -> _Module | None:
    name = node.module or ""
    if node.level:
        base = module.package.split(".") if module.package else []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        name = ".".join([*base, name] if name else base)
    for other in modules.values():
        if other is not module and name and (other.dotted == name or other.dotted.endswith("." + name)):
            return other
    return None


def _module_stores(tree: ast.Module) -> dict[str, int]:
    """How many times each name is bound at module level (imports, assignments, defs)."""
    counts: dict[str, int] = {}
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        else:
            names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del)]
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    return counts


def _as_helper(node: ast.FunctionDef) -> _Helper | None:
    params = [a.arg for a in node.args.args]
    if node.decorator_list or node.args.vararg or node.args.kwarg or node.args.kwonlyargs or len(params) < 2:
        return None
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body:
        return None
    *prints, last = body
    if not all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)
               and s.value.func.id == "print" for s in prints):  # fmt: skip
        return None
    if not isinstance(last, ast.Assert) or not isinstance(last.test, ast.Compare) or len(last.test.ops) != 1:
        return None
    left, right = last.test.left, last.test.comparators[0]
    op = _COMPARE_OPS.get(type(last.test.ops[0]))
    if op not in ("==", "!=") or not isinstance(left, ast.Name) or not isinstance(right, ast.Name):
        return None
    if left.id not in params or right.id not in params:
        return None
    return _Helper(params, op, (params.index(left.id), params.index(right.id)))


class _Transformer(ast.NodeTransformer):
    """Rewrites one module (see the module docstring)."""

    def __init__(self, module: _Module, counter: _Counter, slots: dict[int, Slot], tests: Sequence[str] = (),
                 shuffle: Callable[[list[Any]], None] | None = None) -> None:  # fmt: skip
        self.module = module
        self.counter = counter
        self.slots = slots
        self.tests = tests
        self.shuffle = shuffle or random.Random(0).shuffle
        self.renamed: dict[str, str] = {}
        self.cases: list[tuple[str, dict[str, Any]]] = []
        """In a parametrised test whose columns are held aside: (case id, that case's answer parameters)."""
        self.in_class = False
        self.group = 0
        self.locals: set[str] = set()
        """Names bound in the function being rewritten (they shadow module-level trusted names)."""
        self.answers: dict[str, Any] = {}
        """The function's answer locals → values."""
        self.class_methods: set[str] = set()
        self.keep = False
        """In a function that names a class of the tests with its own comparison: no answer is held aside
        (that comparison runs in the test process, and needs both operands there)."""

    # --- scopes ----------------------------------------------------------------------------------------------
    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = self._statements(node.body, top=False)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        outer, in_class = self.class_methods, self.in_class
        self.in_class = True
        self.class_methods = {s.name for s in node.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
        node.bases = [self.visit(b) for b in node.bases]
        node.keywords = [self.visit(k) for k in node.keywords]
        node.decorator_list = [ast.Constant(REG), *(self.visit(d) for d in node.decorator_list)]
        node.body = self._statements(node.body, top=False) or [ast.Pass()]
        self.class_methods, self.in_class = outer, in_class
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        return self._function(node, register=True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, register: bool) -> ast.AST:
        top = register and self.group == 0  # module- or class-level definitions only
        table = find_parametrization(node, self._is_parametrize, self._value_of) if top and not self.in_class else None
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.args = self.visit(node.args)
        saved = (self.group, self.locals, self.answers, self.keep, self.cases)
        self.group = self.counter.next_group()
        self.locals = _bound_names(node)
        self.keep = self.keep or any(isinstance(n, ast.Name) and n.id in self.module.comparing for n in ast.walk(node))
        self.answers = _answer_locals(node, self) if not self.keep else {}
        self.cases = self._hold_columns(node, table) if table is not None and not self.keep else []
        if self.cases:
            self.answers = {**self.answers, **self.cases[0][1]}
        if top:
            node.decorator_list = [ast.Constant(REG), *node.decorator_list]
        body = [ast.Pass() if _assigns_answer(s, self.answers) else s for s in node.body]
        node.body = self._statements(body, top=True) or [ast.Pass()]
        self.group, self.locals, self.answers, self.keep, self.cases = saved
        return node

    # --- parametrisations held aside (rlbus.envs.swe.grading.split_params) ----------------------------------------
    def _is_parametrize(self, func: ast.expr) -> bool:
        chain = _chain(func)
        if chain is None or chain[-1] != "parametrize" or chain[0] in self.locals:
            return False
        bound = self.module.bound.get(chain[0])
        via_module = bound == ("pytest", None) and chain[1:2] == ["mark"]
        return via_module or (bound == ("pytest", "mark") and len(chain) == 2)

    def _value_of(self, expr: ast.expr) -> tuple[Any, list[str]] | None:
        """The plain value of a literal expression over the module's literal constants, and the constants it
        reads; None when it is not one."""
        names = sorted({n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in self.module.constants})
        saved, self.answers = self.answers, {}
        try:
            for name in names:
                self.answers[name] = _answer(self.module.constants[name], self)
            return _answer(expr, self), names
        except NotAnAnswer:
            return None
        finally:
            self.answers = saved

    def _hold_columns(self, node: ast.FunctionDef | ast.AsyncFunctionDef,
                      table: Parametrization) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
        """The cases, when some parameter is read only inside answers (then the decorator is rewritten and the
        task's node ids renamed); [] otherwise."""
        params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        hidden = [n for n in table.argnames if n in params]
        rows = [dict(zip(table.argnames, row, strict=True)) for row in table.rows]
        while hidden:
            keep = set(hidden)
            for row in rows:
                saved, self.answers = self.answers, {**self.answers, **{n: row[n] for n in hidden}}
                keep -= _inputs(node, self.answers, self)
                self.answers = saved
            if keep == set(hidden):
                break
            hidden = [n for n in hidden if n in keep]
        prefix = f"{self.module.path}::{node.name}"
        named = [t for t in self.tests if t.startswith(prefix + "[")]
        if not hidden or any(t[len(prefix) + 1 : -1] not in table.ids for t in named):
            return []
        try:
            visible = [tuple(None if n in hidden else row[n] for n in table.argnames) for row in rows]
            literals = [literal(v if len(v) > 1 else v[0]) for v in visible]
        except ValueError:
            return []
        order = list(range(len(rows)))
        self.shuffle(order)
        cases = [(f"c{position}", {n: rows[i][n] for n in hidden}) for position, i in enumerate(order)]
        for position, i in enumerate(order):
            self.renamed[f"{prefix}[{table.ids[i]}]"] = f"{prefix}[c{position}]"
        call = node.decorator_list[table.decorator]
        assert isinstance(call, ast.Call)
        call.args[1] = ast.List([literals[i] for i in order], ast.Load())
        call.keywords = [ast.keyword("ids", ast.List([ast.Constant(c) for c, _ in cases], ast.Load()))]
        self.module.inlined.update(table.tables)
        return cases


    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        saved = (self.locals, self.answers)
        self.locals = self.locals | {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        self.answers = {k: v for k, v in self.answers.items() if k not in self.locals}
        self.generic_visit(node)
        self.locals, self.answers = saved
        return node

    def _statements(self, body: list[ast.stmt], top: bool) -> list[ast.stmt]:
        """Each statement rewritten; assertions at the top of a function body, before anything that can
        leave it, are mandatory."""
        out: list[ast.stmt] = []
        mandatory = top
        for stmt in body:
            if isinstance(stmt, ast.Assert):
                out += [ast.copy_location(s, stmt) for s in self._assert(stmt.test, stmt.lineno, mandatory)]
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                call = self._assert_call(stmt.value, mandatory)
                out.append(ast.copy_location(ast.Expr(call), stmt) if call is not None else self.visit(stmt))
            else:
                out.append(self.visit(stmt))
            if mandatory and _can_leave(stmt):
                mandatory = False
        return out

    # --- names bound to trusted objects --------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> ast.AST:
        bound = self.module.bound.get(node.id)
        if isinstance(node.ctx, ast.Load) and bound is not None and node.id not in self.locals:
            return ast.copy_location(ast.Constant(_obj(*bound)), node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        chain = _chain(node) if isinstance(node.ctx, ast.Load) else None
        bound = self.module.bound.get(chain[0]) if chain is not None and chain[0] not in self.locals else None
        if chain is None or bound is None or bound[1] is not None:
            self.generic_visit(node)
            return node
        module, rest = bound[0], chain[1:]
        if f"{module}.{rest[0]}" in TRUSTED_NAMES:
            module, rest = f"{module}.{rest[0]}", rest[1:]
        if rest and rest[0] in TRUSTED_NAMES[module]:
            expr: ast.expr = ast.Constant(_obj(module, rest[0]))
            rest = rest[1:]
        else:
            expr = ast.Constant(_obj(module, None))
        for attr in rest:
            expr = ast.Attribute(expr, attr, ast.Load())
        return ast.copy_location(expr, node)

    def visit_Assert(self, node: ast.Assert) -> list[ast.stmt]:
        return [ast.copy_location(s, node) for s in self._assert(node.test, node.lineno, False)]

    def visit_Call(self, node: ast.Call) -> ast.AST:
        check = self._assert_call(node, False)
        if check is not None:
            return check
        self.generic_visit(node)
        return node

    # --- assertions ----------------------------------------------------------------------------------------
    def _assert(self, test: ast.expr, line: int, mandatory: bool) -> list[ast.stmt]:
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return [s for value in test.values for s in self._assert(value, line, mandatory)]
        op, operands = "truth", [test]
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = test.operand
            if isinstance(inner, ast.Compare) and len(inner.ops) == 1:  # the comparison, then negated:
                op, operands = "not:" + _COMPARE_OPS[type(inner.ops[0])], [inner.left, inner.comparators[0]]
            else:  # not the inverse operator, whose method may be another (__ne__ is not "not __eq__")
                op, operands = "falsy", [inner]
        elif isinstance(test, ast.Compare) and len(test.ops) == 1:
            op, operands = _COMPARE_OPS[type(test.ops[0])], [test.left, test.comparators[0]]
        return [ast.Expr(self._check(op, operands, line, mandatory))]

    def _assert_call(self, call: ast.Call, mandatory: bool) -> ast.expr | None:
        """``self.assertX(...)`` or a call of an assertion helper, as a check; None for any other call."""
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return None
        func = call.func
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
                and func.attr in _UNITTEST and func.attr not in self.class_methods):  # fmt: skip
            op, count = _UNITTEST[func.attr]
            if len(call.args) < count:
                return None
            operands = list(call.args[:count])
            if op in ("is None", "is not None"):
                op, operands = op[: -len(" None")], [*operands, ast.Constant(None)]
            return self._check(op, operands, call.lineno, mandatory)
        if isinstance(func, ast.Name) and func.id in self.module.helpers and func.id not in self.locals:
            helper = self.module.helpers[func.id]
            if len(call.args) != len(helper.params) or call.keywords:
                return None
            operands = [call.args[helper.operands[0]], call.args[helper.operands[1]]]
            return self._check(helper.op, operands, call.lineno, mandatory)
        return None

    def _check(self, op: str, operands: list[ast.expr], line: int, mandatory: bool) -> ast.expr:
        slot = self.counter.next_slot()
        layout, answers, tolerance, sent = "", {}, {}, []
        cases: dict[str, dict[int, list]] = {}
        params = set(self.cases[0][1]) if self.cases else set()
        for position, operand in enumerate(operands):
            kind, value = self.classify(op, operand)
            if kind == "c":
                sent.append(self.visit(operand))
            elif kind == "~":
                value, tolerance = value
            if kind != "c" and params & {n.id for n in ast.walk(operand) if isinstance(n, ast.Name)}:
                for case, row in self.cases:  # this operand's answer, case by case
                    saved, self.answers = self.answers, {**self.answers, **row}
                    form = self.classify(op, operand)[1]
                    self.answers = saved
                    cases.setdefault(case, {})[position] = form[0] if kind == "~" else form
            elif kind != "c":
                answers[position] = value
            layout += kind
        if "~" in layout:
            op = "approx"
        self.slots[slot] = Slot(op, self.module.path, line, layout, answers, tolerance, self.group, mandatory, cases)
        args: list[ast.expr] = [ast.Constant(f"{SLOT}{slot}"), ast.Constant(op), ast.Constant(layout), *sent]
        return ast.Call(ast.Constant(CHECK), args, [])

    def classify(self, op: str, operand: ast.expr) -> tuple[str, Any]:
        """``("a", form)`` for an answer, ``("~", (form, tolerance))`` for an approx answer, ``("c", None)``."""
        inequality = op in ("!=", "not:==")  # what a value must not be is no answer to hold aside
        op = op.removeprefix("not:")
        if op in ("in", "not in") or inequality or self.keep:
            return "c", None
        approx = self._approx(operand) if op == "==" else None
        if approx is not None:
            return "~", approx
        try:
            value = _answer(operand, self)
        except NotAnAnswer:
            return "c", None
        if op in ("is", "is not") and not any(value is s for s in _SINGLETONS):
            return "c", None
        form = _plain_answer(value)
        return ("c", None) if form is None else ("a", form)

    def _approx(self, operand: ast.expr) -> tuple[list, dict[str, Any]] | None:
        if not isinstance(operand, ast.Call) or len(operand.args) != 1:
            return None
        func = operand.func
        bound = self.module.bound.get(func.id) if isinstance(func, ast.Name) else None
        chain = _chain(func) if isinstance(func, ast.Attribute) else None
        if chain is not None and len(chain) == 2 and self.module.bound.get(chain[0]) == ("pytest", None):
            bound = ("pytest", chain[1])
        if bound != ("pytest", "approx"):
            return None
        try:
            value = _answer(operand.args[0], self)
            tolerance = {str(k.arg): _answer(k.value, self) for k in operand.keywords}
        except NotAnAnswer:
            return None
        form = _ENCODE(value)
        if set(tolerance) - {"rel", "abs", "nan_ok"} or opaque(form):
            return None
        return form, tolerance


_ENCODE = encoder()


def _plain_answer(value: Any) -> list | None:
    """The form of an answer, or None when it is not plain (or too large) to hold aside."""
    form = _ENCODE(value)
    return None if opaque(form) or _size(form) > _MAX_ANSWER else form


def _size(form: Any) -> int:
    total, stack = 0, [form]
    while stack:
        node = stack.pop()
        if type(node) is list:
            stack.extend(node)
        total += len(node) if type(node) is str else 1
    return total


def _obj(module: str, attr: str | None) -> str:
    return f"{OBJ}{module}:{attr or ''}"


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` → ``["a", "b", "c"]``; None when the root is not a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _bound_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters and every name the function (and its nested scopes) binds."""
    args = node.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for sub in ast.walk(ast.Module(node.body, [])):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store | ast.Del):
            names.add(sub.id)
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(sub.name)
        elif isinstance(sub, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            names.add(sub.name)
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)
    return names


def _can_leave(stmt: ast.stmt) -> bool:
    """Whether ``stmt`` may end the function early (return, raise, yield), or guards what follows."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return False
    stack: list[ast.AST] = [stmt]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return | ast.Raise | ast.Yield | ast.YieldFrom | ast.Try | ast.With):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("skip", "skipTest", "xfail", "fail", "exit", "importorskip"):
                return True
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.FunctionDef | ast.Lambda))
    return False


def _assigns_answer(stmt: ast.stmt, answers: dict[str, Any]) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in answers)  # fmt: skip


def _answer_locals(node: ast.FunctionDef | ast.AsyncFunctionDef, t: _Transformer) -> dict[str, Any]:
    """The function's answer locals: assigned once at the top of its body from an answer, read only inside
    operands that are answers (a fixed point: dropping one can turn another's use into a computed one)."""
    params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
    candidates: dict[str, ast.expr] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if name not in params:
                candidates[name] = stmt.value
    if not candidates:
        return {}
    stores: dict[str, int] = {}
    nested: set[str] = set()
    stack: list[tuple[ast.AST, bool]] = [(s, False) for s in node.body]
    while stack:  # one pass: stores in this scope, names any nested scope touches
        sub, inner = stack.pop()
        if isinstance(sub, ast.Name):
            if inner:
                nested.add(sub.id)
            elif isinstance(sub.ctx, ast.Store | ast.Del):
                stores[sub.id] = stores.get(sub.id, 0) + 1
        elif isinstance(sub, ast.Global | ast.Nonlocal):
            nested |= set(sub.names)
        scope = isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef | ast.comprehension)
        stack.extend((c, inner or scope) for c in ast.iter_child_nodes(sub))
    candidates = {n: v for n, v in candidates.items() if stores.get(n) == 1 and n not in nested}
    while candidates:
        saved = t.answers
        values: dict[str, Any] = {}
        t.answers = values
        for name, expr in candidates.items():  # in order: an answer may use the ones before it
            try:
                value = _answer(expr, t)
            except NotAnAnswer:
                continue
            if _plain_answer(value) is not None:
                values[name] = value
        used_as_input = _inputs(node, values, t) if values else set()
        t.answers = saved
        keep = {n: candidates[n] for n in values if n not in used_as_input}
        if len(keep) == len(candidates):
            return values
        candidates = keep
    return {}


def _inputs(node: ast.FunctionDef | ast.AsyncFunctionDef, answers: dict[str, Any], t: _Transformer) -> set[str]:
    """The answer candidates read anywhere but inside an answer operand of an assertion."""
    inside: set[int] = set()
    loads: list[ast.Name] = []
    for sub in ast.walk(ast.Module(node.body, [])):
        if isinstance(sub, ast.Name):
            if isinstance(sub.ctx, ast.Load) and sub.id in answers:
                loads.append(sub)
        elif isinstance(sub, ast.Assert | ast.Call):
            for op, operands in _assertion_operands(sub, t):
                for operand in operands:
                    if t.classify(op, operand)[0] != "c":
                        inside |= {id(n) for n in ast.walk(operand) if isinstance(n, ast.Name)}
    return {n.id for n in loads if id(n) not in inside}


def _assertion_operands(node: ast.AST, t: _Transformer) -> list[tuple[str, list[ast.expr]]]:
    """The (operation, operands) of an assertion statement or assertion call, as `_Transformer` splits them."""
    out: list[tuple[str, list[ast.expr]]] = []
    if isinstance(node, ast.Assert):
        tests = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else [
            node.test]  # fmt: skip
        for test in tests:
            if isinstance(test, ast.Compare) and len(test.ops) == 1:
                out.append((_COMPARE_OPS[type(test.ops[0])], [test.left, test.comparators[0]]))
            elif isinstance(test, ast.UnaryOp) and isinstance(test.operand, ast.Compare):
                inner = test.operand
                if len(inner.ops) == 1:
                    out.append((_COMPARE_OPS[type(inner.ops[0])], [inner.left, inner.comparators[0]]))
            else:
                out.append(("truth", [test]))
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.attr in _UNITTEST:
            op, count = _UNITTEST[func.attr]
            out.append((op.split(" None")[0], list(node.args[:count])))
        elif isinstance(func, ast.Name) and func.id in t.module.helpers:
            helper = t.module.helpers[func.id]
            if len(node.args) == len(helper.params):
                out.append((helper.op, [node.args[helper.operands[0]], node.args[helper.operands[1]]]))
    return out


def _answer(node: ast.expr, t: _Transformer) -> Any:
    """The value of an operand the worker can compute without the repository; NotAnAnswer otherwise."""
    value = _evaluate(node, t)
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset) and len(value) > _MAX_ANSWER:
        raise NotAnAnswer("too large")
    return value


def _evaluate(node: ast.expr, t: _Transformer) -> Any:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str) and node.value.startswith("\x00rlbus:"):
            raise NotAnAnswer("a marker")
        return node.value
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        if any(isinstance(e, ast.Starred) for e in node.elts):
            raise NotAnAnswer("starred")
        elements = [_answer(e, t) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](elements)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise NotAnAnswer("**")
        return {_answer(k, t): _answer(v, t) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    if isinstance(node, ast.Name):
        if node.id in t.answers:
            return t.answers[node.id]
        raise NotAnAnswer(node.id)
    if isinstance(node, ast.UnaryOp):
        operand = _answer(node.operand, t)
        unary: dict[type, Callable[[Any], Any]] = {
            ast.USub: lambda x: -x, ast.UAdd: lambda x: +x, ast.Not: lambda x: not x, ast.Invert: lambda x: ~x,
        }  # fmt: skip
        return _pure(lambda: unary[type(node.op)](operand))
    if isinstance(node, ast.BinOp):
        return _binop(node, _answer(node.left, t), _answer(node.right, t))
    if isinstance(node, ast.Subscript):
        container = _answer(node.value, t)
        index = _slice(node.slice, t)
        return _pure(lambda: container[index])
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                v = _answer(value.value, t)
                v = {-1: v, 115: str(v), 114: repr(v), 97: ascii(v)}[value.conversion]
                spec = _answer(value.format_spec, t) if value.format_spec is not None else ""
                parts.append(_pure(partial(format, v, spec)))
        return "".join(parts)
    if isinstance(node, ast.Call):
        return _call(node, t)
    raise NotAnAnswer(type(node).__name__)


def _slice(node: ast.expr, t: _Transformer) -> Any:
    if isinstance(node, ast.Slice):
        parts = [_answer(p, t) if p is not None else None for p in (node.lower, node.upper, node.step)]
        return slice(*parts)
    return _answer(node, t)


def _call(node: ast.Call, t: _Transformer) -> Any:
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise NotAnAnswer("*args")
    args = [_answer(a, t) for a in node.args]
    kwargs = {k.arg: _answer(k.value, t) for k in node.keywords if k.arg is not None}
    func = node.func
    if isinstance(func, ast.Name) and func.id in _ANSWER_CALLS:
        if func.id in t.locals or t.module.assigned.get(func.id) or t.module.bound.get(func.id):
            raise NotAnAnswer("shadowed")
        if func.id == "range" and len(range(*args)) > _MAX_ANSWER:
            raise NotAnAnswer("too large")
        return _pure(lambda: _ANSWER_CALLS[func.id](*args, **kwargs))
    if isinstance(func, ast.Attribute):
        receiver = _answer(func.value, t)
        if func.attr not in _SAFE_METHODS.get(type(receiver), frozenset()):
            raise NotAnAnswer(func.attr)
        if func.attr == "format" and any(not isinstance(a, str | int | float) for a in (*args, *kwargs.values())):
            raise NotAnAnswer("format of a container")
        return _pure(lambda: getattr(receiver, func.attr)(*args, **kwargs))
    raise NotAnAnswer("a call")


def _binop(node: ast.BinOp, left: Any, right: Any) -> Any:
    op = type(node.op)
    if op is ast.Pow and (not isinstance(right, int) or abs(right) > 64 or abs(left) > 1 << 64):
        raise NotAnAnswer("a large power")
    if op in (ast.LShift, ast.RShift) and (not isinstance(right, int) or right > 64):
        raise NotAnAnswer("a large shift")
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | bytes | list | tuple) and isinstance(n, int) and len(seq) * n > _MAX_ANSWER:
                raise NotAnAnswer("too large")
    table: dict[type, Callable[[Any, Any], Any]] = {
        ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
        ast.Pow: lambda a, b: a**b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
        ast.BitOr: lambda a, b: a | b, ast.BitAnd: lambda a, b: a & b, ast.BitXor: lambda a, b: a ^ b,
    }  # fmt: skip
    if op not in table or (op is ast.Mod and isinstance(left, str | bytes)):  # "%" formatting: leave it
        raise NotAnAnswer("an operator")
    return _pure(lambda: table[op](left, right))


def _pure(compute: Callable[[], Any]) -> Any:
    """Evaluate on builtin values only; what raises is not an answer (the test computes it)."""
    try:
        value = compute()
    except Exception as exc:
        raise NotAnAnswer(str(exc)) from None
    if isinstance(value, float) and math.isnan(value):
        raise NotAnAnswer("nan")  # nan != nan: leave such comparisons to run as written
    return value
