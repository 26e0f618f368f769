"""docs/reference/config.md: every table and field of the run config, from the structs' own ``#:`` docs.

The tables are `rlbus.launch.config.RunConfig`'s fields; a field whose type is itself a struct is a nested table
(``[trainer.grpo]`` is `rlbus.training.config.GRPOConfig`), except ``[model]``'s policy shape, whose fields sit
in ``[model]`` itself (`rlbus.launch.config._model_section`). Defaults are the structs' own, written as TOML.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

import msgspec

from rlbus.launch import config as run_config
from rlbus_tools.docs.markdown import GENERATED, code, docstring, inline, table, toml_value
from rlbus_tools.docs.source import class_doc, field_docs, module_doc

#: Struct-typed fields whose fields are written in the parent table itself (``[model] d_model = 128``).
FLATTENED = {("model", "policy")}

_TOML_TYPES = {"str": "string", "int": "integer", "float": "float", "bool": "boolean", "Any": "any"}


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    annotation: str
    default: Any
    doc: str
    struct: type | None


def _is_struct(kind: Any) -> bool:
    return isinstance(kind, type) and (issubclass(kind, msgspec.Struct) or dataclasses.is_dataclass(kind))


def _default(info: Any) -> Any:
    if info.default is not msgspec.NODEFAULT and info.default is not dataclasses.MISSING:
        return info.default
    factory = info.default_factory
    return factory() if factory not in (msgspec.NODEFAULT, dataclasses.MISSING) else msgspec.NODEFAULT


def fields(cls: type) -> list[Field]:
    """The fields of a config struct or dataclass, in declaration order, with their docs and defaults."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    infos: Any = msgspec.structs.fields(cls) if issubclass(cls, msgspec.Struct) else dataclasses.fields(cls)  # type: ignore[arg-type]
    out = []
    for info in infos:
        annotation, doc = docs.get(info.name, ("", ""))
        kind = hints[info.name]
        out.append(Field(info.name, annotation, _default(info), doc, kind if _is_struct(kind) else None))
    return out


def toml_type(annotation: str) -> str:
    """A Python annotation as the TOML value it takes: ``Literal["a", "b"] | None`` → ``"a" | "b"``."""
    return " | ".join(_toml_types(ast.parse(annotation, mode="eval").body))


def _toml_types(node: ast.expr) -> Iterator[str]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        yield from _toml_types(node.left)
        yield from _toml_types(node.right)
    elif isinstance(node, ast.Constant) and node.value is None:
        return
    elif isinstance(node, ast.Name):
        yield _TOML_TYPES.get(node.id, f"table ({node.id})")
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id == "Literal":
            yield from (code(toml_value(arg.value)) for arg in args if isinstance(arg, ast.Constant))
        elif node.value.id == "dict":
            yield f"table of {' | '.join(_toml_types(args[1]))}"
        elif node.value.id in ("list", "tuple"):
            items = [arg for arg in args if not (isinstance(arg, ast.Constant) and arg.value is Ellipsis)]
            kinds = sorted({kind for arg in items for kind in _toml_types(arg)})
            yield f"array of {' | '.join(kinds)}"
        else:
            yield ast.unparse(node)
    else:
        yield ast.unparse(node)


def _row(path: str, field: Field) -> list[str]:
    anchor = f'<a id="{path}"></a>{code(field.name)}'
    if field.default is msgspec.NODEFAULT:
        default = "—"
    else:
        default = "unset" if field.default is None else code(toml_value(field.default))
    return [anchor, toml_type(field.annotation) if field.annotation else "—", default, inline(field.doc)]


def _section(path: str, cls: type, summary: str) -> Iterator[str]:
    """The Markdown of table ``path`` (``trainer.grpo``) and of the tables nested in it."""
    own = [f for f in fields(cls) if f.struct is None or (path, f.name) in FLATTENED]
    nested = [f for f in fields(cls) if f.struct is not None and (path, f.name) not in FLATTENED]
    set_by_run = {name.rsplit(".", 1)[1]: why for name, why in run_config.SET_BY_THE_RUN.items()
                  if name.rsplit(".", 1)[0] == path}
    yield f"## `[{path}]` {{#{path}}}"
    doc = class_doc(cls)
    for text in ([summary] if "." in path or not doc else []) + ([doc] if doc else []):
        yield ""
        yield docstring(text)
    rows = []
    for field in own:
        if (path, field.name) in FLATTENED and field.struct is not None:
            shape = field.default  # the embedding struct's default shape, not the shape class's own defaults
            rows += [_row(f"{path}.{sub.name}", dataclasses.replace(sub, default=getattr(shape, sub.name)))
                     for sub in fields(field.struct)]
            continue
        if field.name not in set_by_run:
            rows.append(_row(f"{path}.{field.name}", field))
    rows += [[f'<a id="{path}.{f.name}"></a>{code(f.name)}', "table", "—",
              f"{inline(f.doc)} See [`[{path}.{f.name}]`](#{path}.{f.name})."] for f in nested]
    yield ""
    yield table(("field", "type", "default", "meaning"), rows)
    for name, why in set_by_run.items():
        yield ""
        yield f"`{name}` is not a setting here: {why}."
    for field in own:
        if (path, field.name) in FLATTENED and field.struct is not None:
            yield ""
            yield (f"With `kind = \"policy\"`, the fields from `{field.struct.__name__}` on ({inline(field.doc)}) "
                   f"are written in `[{path}]` itself; each one not given keeps the default shown.")
    for field in nested:
        yield ""
        assert field.struct is not None
        yield from _section(f"{path}.{field.name}", field.struct, field.doc)


def render() -> str:
    parts = [
        GENERATED,
        "",
        "# Run config reference",
        "",
        "Every table and field of the run config, generated from the docs of the config structs' fields "
        "(`rlbus/launch/config.py` and the structs it embeds). How to write one and run it: "
        "[a distributed run](../distributed.md); check one with `rlbus config check FILE`.",
        "",
        docstring(module_doc(run_config)),
        "",
    ]
    for field in fields(run_config.RunConfig):
        assert field.struct is not None, f"RunConfig.{field.name} is not a table"
        parts += [*_section(field.name, field.struct, field.doc), ""]
    parts += [
        "## Moved fields {#moved}",
        "",
        "A config that sets a field at its old place fails naming the new one.",
        "",
        table(("old", "now"), ([code(old), f"[`{new}`](#{new})"] for old, new in run_config.MOVED.items())),
        "",
    ]
    return "\n".join(parts)
