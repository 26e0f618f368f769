"""AST-located, text-level bug injections into one function, in the manner of SWE-smith's procedural bugs.

SWE-smith (Yang et al., 2025, "SWE-smith: Scaling Data for Software Engineering Agents") makes task
instances by modifying a function of a healthy repository — among its strategies, procedural AST
modifications such as flipping an operator, inverting a condition or removing a branch — and keeping only
modifications that break some existing tests. This module is rlbus's own take on that strategy: each
mutator finds *sites* in a function's AST and rewrites only the source characters of that site (the
operator token, the condition, the argument pair), so the bug is a one-line diff in the author's own
formatting, never a file re-printed by ``ast.unparse``. That keeps bug.patch and solution.patch tiny and
makes "the solution is the reverse of the bug" literally true.

    kind               site                                         rewrite
    =================  ===========================================  =====================================
    flip_comparison    a single-operator comparison                 < ↔ <=, > ↔ >=, == ↔ !=, in ↔ not in, is ↔ is not
    invert_condition   the test of an if / while / conditional      c → not (c)  (not c → c)
    off_by_one         an index, slice bound or range() argument    n → n ± 1
    swap_arguments     a call with two different positional args    f(a, b) → f(b, a)
    drop_guard         an ``if`` whose body ends in return/raise/…  the statement is deleted
    change_constant    an int or bool literal outside indexing      n → n + 1, True ↔ False
    swap_operator      a binary + / - or a two-operand and / or     + ↔ -, and ↔ or
    =================  ===========================================  =====================================

Everything is deterministic: sites come in source order and the caller's ``random.Random`` picks among
them, so one seed gives one corpus.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

KINDS = (
    "flip_comparison",
    "invert_condition",
    "off_by_one",
    "swap_arguments",
    "drop_guard",
    "change_constant",
    "swap_operator",
)

_COMPARE_FLIP = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
    ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
}  # fmt: skip
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass(frozen=True)
class Mutation:
    """One rewrite of ``source``: characters ``start:end`` become ``replacement``."""

    kind: str
    start: int
    end: int
    replacement: str
    line: int
    """1-based line of the site (for metadata; never shown to the agent)."""

    def apply(self, source: str) -> str:
        return source[: self.start] + self.replacement + source[self.end :]


class _Offsets:
    """ast positions (1-based line, UTF-8 byte column) → offsets into the str source."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        text = self.lines[line - 1]
        return self.starts[line - 1] + len(text.encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.at(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def text(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.source[start:end]


def find_function(tree: ast.Module, firstlineno: int, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function whose code object starts at ``firstlineno`` (its ``def`` or first decorator line)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            lines = {node.lineno, *(d.lineno for d in node.decorator_list)}
            if firstlineno in lines:
                return node
    return None


def sites(source: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list[Mutation]]:
    """Every mutation each kind could make inside ``function`` (docstring excluded), in source order."""
    offsets = _Offsets(source)
    found: dict[str, list[Mutation]] = {kind: [] for kind in KINDS}
    for kind, finder in _FINDERS.items():
        for mutation in finder(function, offsets):
            if mutation.replacement != source[mutation.start : mutation.end] and _parses(mutation.apply(source)):
                found[kind].append(mutation)
    return {kind: ms for kind, ms in found.items() if ms}


def choose(
    source: str, function: ast.FunctionDef | ast.AsyncFunctionDef, rng: random.Random, *, tried: set[Mutation]
) -> Mutation | None:
    """A kind uniformly among those with untried sites, then a site of it; None when all are tried."""
    available = {kind: [m for m in ms if m not in tried] for kind, ms in sites(source, function).items()}
    kinds = sorted(kind for kind, ms in available.items() if ms)
    if not kinds:
        return None
    kind = rng.choice(kinds)
    return rng.choice(available[kind])


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def _body_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        yield from ast.walk(statement)


def _flip_comparison(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    for node in _body_nodes(function):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_FLIP:
            old, new = _COMPARE_FLIP[type(node.ops[0])]
            _, gap_start = off.span(node.left)
            gap_end, _ = off.span(node.comparators[0])
            gap = off.source[gap_start:gap_end]
            pattern = r"\bnot\s+in\b|\bis\s+not\b|\bin\b|\bis\b" if old[0].isalpha() else re.escape(old)
            match = re.search(pattern, gap)
            if match is None or " ".join(match.group(0).split()) != old:
                continue
            yield Mutation("flip_comparison", gap_start + match.start(), gap_start + match.end(), new, node.lineno)


def _invert_condition(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    for node in _body_nodes(function):
        if isinstance(node, ast.If | ast.While | ast.IfExp) and node.test.lineno == node.test.end_lineno:
            test = node.test
            start, end = off.span(test)
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                replacement = off.text(test.operand)
                if isinstance(test.operand, ast.BoolOp | ast.Compare | ast.IfExp | ast.NamedExpr):
                    replacement = f"({replacement})"
            elif isinstance(test, ast.Name | ast.Attribute | ast.Call | ast.Subscript | ast.Constant):
                replacement = f"not {off.text(test)}"
            else:
                replacement = f"not ({off.text(test)})"
            yield Mutation("invert_condition", start, end, replacement, test.lineno)


def _index_positions(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.expr]:
    for node in _body_nodes(function):
        if isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Slice):
                yield from (e for e in (node.slice.lower, node.slice.upper) if e is not None)
            elif isinstance(node.ctx, ast.Load):
                yield node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            yield from (a for a in node.args if not isinstance(a, ast.Starred))


def _off_by_one(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    for expr in _index_positions(function):
        if expr.lineno != expr.end_lineno:
            continue
        start, end = off.span(expr)
        if isinstance(expr, ast.Constant) and type(expr.value) is int:
            yield Mutation("off_by_one", start, end, str(expr.value + 1), expr.lineno)
            if expr.value > 0:
                yield Mutation("off_by_one", start, end, str(expr.value - 1), expr.lineno)
        elif isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and isinstance(expr.operand, ast.Constant):
            continue  # seq[-1] → seq[-2] is covered by the constant case of its operand below, not here
        elif isinstance(expr, ast.Name | ast.Attribute | ast.Call | ast.Subscript | ast.BinOp):
            if isinstance(expr, ast.BinOp) and not isinstance(expr.op, ast.Add | ast.Sub | ast.Mult | ast.FloorDiv):
                continue
            text = off.text(expr)
            yield Mutation("off_by_one", start, end, f"{text} + 1", expr.lineno)
            yield Mutation("off_by_one", start, end, f"{text} - 1", expr.lineno)


def _swap_arguments(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    for node in _body_nodes(function):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        first, second = node.args[0], node.args[1]
        if isinstance(first, ast.Starred) or isinstance(second, ast.Starred):
            continue
        if first.lineno != second.end_lineno:
            continue
        a, b = off.text(first), off.text(second)
        if a == b:
            continue
        start, middle = off.span(first)
        gap_end, end = off.span(second)
        replacement = b + off.source[middle:gap_end] + a
        yield Mutation("swap_arguments", start, end, replacement, node.lineno)


def _drop_guard(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    for parent in (function, *_body_nodes(function)):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if not isinstance(block, list) or len(block) < 2:
                continue
            for statement in block:
                if not isinstance(statement, ast.If) or statement.orelse:
                    continue
                if not isinstance(statement.body[-1], _EXITS):
                    continue
                start = off.starts[statement.lineno - 1]
                end = off.starts[statement.end_lineno] if statement.end_lineno is not None else len(off.source)
                line_text = off.source[start : off.at(statement.lineno, statement.col_offset)]
                after = off.source[off.span(statement)[1] : end]
                if line_text.strip() or after.strip():
                    continue  # shares its lines with other code (``x = 1; if …``)
                yield Mutation("drop_guard", start, end, "", statement.lineno)


def _change_constant(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    indexing = {id(e) for e in _index_positions(function)}
    for node in _body_nodes(function):
        if not isinstance(node, ast.Constant) or id(node) in indexing:
            continue
        start, end = off.span(node)
        if node.value is True or node.value is False:
            yield Mutation("change_constant", start, end, str(not node.value), node.lineno)
        elif type(node.value) is int and off.source[start:end].isdigit():
            yield Mutation("change_constant", start, end, str(node.value + 1), node.lineno)


def _swap_operator(function: ast.FunctionDef | ast.AsyncFunctionDef, off: _Offsets) -> Iterator[Mutation]:
    for node in _body_nodes(function):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            _, gap_start = off.span(node.left)
            gap_end, _ = off.span(node.right)
            old, new = ("+", "-") if isinstance(node.op, ast.Add) else ("-", "+")
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            _, gap_start = off.span(node.values[0])
            gap_end, _ = off.span(node.values[1])
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        else:
            continue
        gap = off.source[gap_start:gap_end]
        match = re.search(rf"\b{old}\b" if old.isalpha() else re.escape(old), gap)
        if match is None or "#" in gap:
            continue
        yield Mutation("swap_operator", gap_start + match.start(), gap_start + match.end(), new, node.lineno)


_FINDERS: dict[str, Callable[[ast.FunctionDef | ast.AsyncFunctionDef, _Offsets], Iterator[Mutation]]] = {
    "flip_comparison": _flip_comparison,
    "invert_condition": _invert_condition,
    "off_by_one": _off_by_one,
    "swap_arguments": _swap_arguments,
    "drop_guard": _drop_guard,
    "change_constant": _change_constant,
    "swap_operator": _swap_operator,
}
