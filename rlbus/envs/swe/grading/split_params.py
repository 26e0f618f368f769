"""A parametrisation's answer columns, held aside: the part of `rlbus.envs.swe.grading.split` for
``@pytest.mark.parametrize`` tables.

``@pytest.mark.parametrize(("singular", "plural"), TABLE)`` hands each case's expected value to the test as
an argument, and pytest names the case after it (``test_pluralize[search-searches]``). When a parameter is
read only inside the answers of the test's assertions, its column is an answer: the visible decorator gets
``None`` in its place, the cases in a shuffled order under ids of their own (``c0``, ``c1`` …), and the
launcher holds each case's answers. The task's node ids are renamed to match (`Split.renamed`), so
neither the table nor a node id on the command line carries the column. A parametrisation qualifies when
its table is a literal (inline, or a module-level name bound once to one), its rows are plain, it has no
``ids``/``indirect``/marks, and the ids this module computes for the original rows — pytest's rules for
plain values — cover every node id the task names for the test; otherwise it is left as written.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass
class Parametrization:
    decorator: int
    """Position in the function's decorator list."""
    argnames: list[str]
    rows: list[tuple[Any, ...]]
    ids: list[str]
    """pytest's id of each row, as written."""
    tables: list[str]
    """The module-level names the rows come from."""


def find_parametrization(
    node: ast.FunctionDef | ast.AsyncFunctionDef, is_parametrize: Any, value_of: Any
) -> Parametrization | None:
    """The function's parametrisation when it can be held aside (see the module docstring). ``is_parametrize``:
    whether a decorator's callee is ``pytest.mark.parametrize``; ``value_of(expr)``: the plain value of a
    literal expression over module-level literals (``(value, the names it reads)``), or None."""
    found = [(i, d) for i, d in enumerate(node.decorator_list) if isinstance(d, ast.Call) and is_parametrize(d.func)]
    if len(found) != 1:
        return None
    index, call = found[0]
    if call.keywords or len(call.args) != 2:
        return None
    names = value_of(call.args[0])
    table = value_of(call.args[1])
    if names is None or table is None:
        return None
    argnames = names[0]
    if isinstance(argnames, str):
        argnames = [n.strip() for n in argnames.split(",") if n.strip()]
    if not isinstance(argnames, list | tuple) or not all(isinstance(n, str) for n in argnames):
        return None
    values, source = table
    if not isinstance(values, list | tuple):
        return None
    rows = [tuple(r) if len(argnames) > 1 else (r,) for r in values]
    if any(len(r) != len(argnames) for r in rows):
        return None
    return Parametrization(index, list(argnames), rows, pytest_ids(list(argnames), rows), source)


def pytest_ids(argnames: list[str], rows: list[tuple[Any, ...]]) -> list[str]:
    """The ids pytest gives these rows (its rules for strings, numbers, booleans and None; anything else is
    named after the argument and the row), made unique as pytest makes them."""

    def part(value: Any, argname: str, idx: int) -> str:
        if isinstance(value, str):
            return _printable(value.encode("unicode_escape").decode("ascii"))
        if isinstance(value, bytes):
            return _printable("".join(chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02x}" for b in value))
        if value is None or isinstance(value, bool | int | float | complex):
            return str(value)
        return f"{argname}{idx}"

    ids = ["-".join(part(v, n, i) for v, n in zip(row, argnames, strict=True)) for i, row in enumerate(rows)]
    counts = Counter(ids)
    if len(counts) == len(ids):
        return ids
    seen: Counter[str] = Counter()
    taken = set(ids)
    out = []
    for id_ in ids:
        if counts[id_] == 1:
            out.append(id_)
            continue
        suffix = "_" if id_ and id_[-1].isdigit() else ""
        new = f"{id_}{suffix}{seen[id_]}"
        while new in taken:
            seen[id_] += 1
            new = f"{id_}{suffix}{seen[id_]}"
        seen[id_] += 1
        taken.add(new)
        out.append(new)
    return out


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def literal(value: Any) -> ast.expr:
    """An expression that evaluates to ``value`` (plain values only)."""
    if isinstance(value, tuple | list):
        elements = [literal(v) for v in value]
        return ast.Tuple(elements, ast.Load()) if isinstance(value, tuple) else ast.List(elements, ast.Load())
    if isinstance(value, dict):
        return ast.Dict([literal(k) for k in value], [literal(v) for v in value.values()])
    if isinstance(value, set | frozenset):
        return ast.Call(ast.Name("frozenset" if isinstance(value, frozenset) else "set", ast.Load()),
                        [ast.List([literal(v) for v in value], ast.Load())], [])  # fmt: skip
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise ValueError("not a literal")
    return ast.Constant(value)
