"""Field documentation read from the source, the way Sphinx's autodoc reads it: a ``#:`` comment block right
above a field, or a string literal right below it (PEP 257's attribute docstring).

The config and schema structs document their fields this way (docs/architecture.md §9), and the reference pages
are generated from it, so a field's doc has one home: the line above the field. Reading the source rather than
the objects is the only way: Python keeps neither comments nor attribute docstrings at run time.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path
from typing import Any


@functools.cache
def _module_tree(path: str) -> tuple[ast.Module, tuple[str, ...]]:
    text = Path(path).read_text()
    return ast.parse(text, filename=path), tuple(text.splitlines())


def _class_node(cls: type) -> tuple[ast.ClassDef, tuple[str, ...]]:
    path = inspect.getsourcefile(cls)
    if path is None:
        raise ValueError(f"{cls.__qualname__}: no source file to read its field docs from")
    tree, lines = _module_tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, lines
    raise ValueError(f"{cls.__qualname__}: class not found in {path}")


def _comment_above(lines: tuple[str, ...], lineno: int) -> str:
    """The ``#:`` lines directly above line ``lineno`` (1-based), joined."""
    block: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        block.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(part for part in block if part)


def _own_field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``name → (annotation as written, doc)`` for the fields declared in ``cls`` itself."""
    node, lines = _class_node(cls)
    docs: dict[str, tuple[str, str]] = {}
    body = node.body
    for index, statement in enumerate(body):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        doc = _comment_above(lines, statement.lineno)
        following = body[index + 1] if index + 1 < len(body) else None
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            doc = " ".join(filter(None, (doc, inspect.cleandoc(following.value.value).replace("\n", " "))))
        docs[statement.target.id] = (ast.unparse(statement.annotation), doc)
    return docs


def field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``name → (annotation, doc)`` for every field of ``cls``, inherited ones included (a subclass's doc of
    a redeclared field wins)."""
    docs: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if _has_source(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _has_source(cls: type) -> bool:
    """Whether ``cls`` is defined in Python source (not ``object``, not a C base such as ``msgspec.Struct``)."""
    try:
        inspect.getsource(cls)
    except (TypeError, OSError):
        return False
    return True


def class_doc(cls: type) -> str:
    """The class's own docstring (not an inherited one), cleaned; "" when it has none."""
    doc = cls.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def module_doc(obj: Any) -> str:
    """The docstring of the module that defines ``obj`` (a class or a module)."""
    module = obj if inspect.ismodule(obj) else inspect.getmodule(obj)
    doc = getattr(module, "__doc__", None)
    return inspect.cleandoc(doc) if doc else ""
