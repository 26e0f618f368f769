"""docs/reference/topics.md and docs/reference/schemas.md: the topics `rlbus topics create` makes
(`rlbus.bus.topics`) and the record schemas they carry (`rlbus.schemas`), with their fields' ``#:`` docs.

A topic's key is a lambda in its declaration; it is read from the source (``key=lambda m: m.prompt_id`` →
``prompt_id``). The schemas page starts at the five messages and follows every struct their fields hold.
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Iterator
from typing import Any

import msgspec

from rlbus import schemas
from rlbus.bus import topics
from rlbus_tools.docs.markdown import GENERATED, code, docstring, inline, table
from rlbus_tools.docs.source import class_doc, field_docs, module_doc

#: The messages, in the order a record travels the loop.
MESSAGES = (schemas.Prompt, schemas.Rollout, schemas.Reward, schemas.WeightVersion, schemas.Served)


def topic_keys() -> dict[str, str]:
    """``topic name → key expression`` read from the ``Topic(...)`` declarations of `rlbus.bus.topics`."""
    tree = ast.parse(inspect.getsource(topics))
    keys = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Topic"):
            continue
        name = node.args[0]
        key = next((k.value for k in node.keywords if k.arg == "key"), None)
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and isinstance(key, ast.Lambda):
            argument = key.args.args[0].arg
            keys[name.value] = ast.unparse(key.body).replace(f"{argument}.", "")
    return keys


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def render_topics() -> str:
    keys = topic_keys()
    rows = []
    for spec in topics.topic_specs():
        typed = topics.TYPED_TOPICS.get(spec.name)
        message = f"[`{typed.schema.__name__}`](schemas.md#{_anchor(typed.schema)})" if typed else "original bytes"
        config = ", ".join(f"`{k}={v}`" for k, v in spec.config.items())
        rows.append([code(spec.name), message, code(keys[spec.name]) if spec.name in keys else "original key",
                     str(spec.partitions), config, spec.doc])
    return "\n".join([
        GENERATED,
        "",
        "# Topics",
        "",
        "Every topic `rlbus topics create` makes, with its dead-letter topic, generated from `rlbus/bus/topics.py`. "
        "Why each key and what each delivery guarantees: [architecture §2–3](../architecture.md#2-topics). With a "
        "run namespace every name is prefixed (`exp1.rl.rollouts.v1`). `rlbus topics create --partitions N` "
        "changes the data topics' partitions (the weights topics keep one); `--replication 3` adds "
        "`min.insync.replicas=2`.",
        "",
        docstring(module_doc(topics)),
        "",
        table(("topic", "message", "key", "partitions", "config", "what it carries"), rows),
        "",
    ])


def _structs(kind: Any) -> Iterator[type]:
    """The structs a field's type names, however nested (``list[Turn]``, ``TensorData | None``)."""
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        yield kind
    for argument in typing.get_args(kind):
        yield from _structs(argument)


def _reachable() -> list[type]:
    """The messages, then every struct their fields hold, in the order first met."""
    seen: list[type] = []
    queue: list[type] = list(MESSAGES)
    while queue:
        cls = queue.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        queue += [s for kind in typing.get_type_hints(cls).values() for s in _structs(kind)]
    return seen


def _default(info: msgspec.structs.FieldInfo) -> str:
    if info.default is not msgspec.NODEFAULT:
        return code(repr(info.default))
    factory = info.default_factory
    if factory is msgspec.NODEFAULT:
        return "required"
    return code(f"{factory.__name__}()" if isinstance(factory, type) and issubclass(factory, msgspec.Struct)
                else repr(factory()))


def _struct_section(cls: type, known: list[type]) -> Iterator[str]:
    yield f"## `{cls.__name__}` {{#{_anchor(cls)}}}"
    doc = class_doc(cls)
    if cls in MESSAGES:  # a message's module docstring says what it is, who produces and who consumes it
        doc = module_doc(cls)
        yield ""
        yield f"`{cls.__module__}`, `schema_version` {vars(cls)['SCHEMA_VERSION']}."
    if doc:
        yield ""
        yield docstring(doc)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for info in msgspec.structs.fields(cls):
        annotation, text = docs.get(info.name, ("", ""))
        links = [s for s in _structs(hints[info.name]) if s in known]
        kind = code(annotation) + "".join(f" ([{s.__name__}](#{_anchor(s)}))" for s in links)
        rows.append([code(info.name), kind, _default(info), inline(text)])
    yield ""
    yield table(("field", "type", "default", "meaning"), rows)
    yield ""


def render_schemas() -> str:
    known = _reachable()
    parts = [
        GENERATED,
        "",
        "# Record schemas",
        "",
        "The messages on the topics ([topics](topics.md)) and the structs inside them, generated from "
        "`rlbus/schemas/`. Fields without a description are named for what they hold.",
        "",
        docstring(module_doc(schemas.Message)),
        "",
    ]
    for cls in known:
        parts += list(_struct_section(cls, known))
    return "\n".join(parts)
