"""docs/reference/cli.md: every ``rlbus`` command, group and option, read from the typer app itself.

The app (`rlbus.cli.app`) is turned into its click command tree, the tree `rlbus --help` prints from, and each
command's help and each option's help record (flags, ``[default: …]``, ``[env var: …]``, ``[required]``) are
written as `--help` shows them. Commands other installed packages add through the ``rlbus.cli`` entry points
are left out, except the repository's own tooling's (`rlbus_tools`), so the page does not depend on what else
is installed; hidden commands (the stand-ins for missing tooling) are left out too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import typer

from rlbus.cli.app import app
from rlbus_tools.docs.markdown import GENERATED, code, table

#: Modules whose commands the page documents (the library's CLI and the repository's tooling).
OWN = ("rlbus.", "rlbus_tools.")

#: typer's shell-completion options: the same on every typer app, not rlbus's.
COMPLETION = {"install_completion", "show_completion"}


def _text(help_text: str) -> str:
    """Help text as Markdown that shows it as written: no emphasis, no HTML, paragraphs kept."""
    text = help_text.replace("\b\n", "").replace("\b", "")
    text = re.sub(r"([*_\\])", r"\\\1", text)  # literal, not emphasis
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    return "\n\n".join(" ".join(part.split()) for part in text.split("\n\n"))


def _own(command: Any, ctx: Any) -> bool:
    """A command whose callback is rlbus's or its tooling's, or a group with such a command."""
    if command.hidden:
        return False
    if hasattr(command, "list_commands"):
        subs = (command.get_command(ctx, name) for name in command.list_commands(ctx))
        return any(sub is not None and _own(sub, sub.context_class(sub, parent=ctx)) for sub in subs)
    return str(getattr(command.callback, "__module__", "")).startswith(OWN)


def _commands(command: Any, ctx: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    yield path, command, ctx
    if not hasattr(command, "list_commands"):
        return
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        sub_ctx = None if sub is None else sub.context_class(sub, parent=ctx, info_name=name)
        if sub is not None and _own(sub, sub_ctx):
            yield from _commands(sub, sub_ctx, (*path, name))


def _anchor(path: tuple[str, ...]) -> str:
    return "-".join(path)


def _section(path: tuple[str, ...], command: Any, ctx: Any) -> Iterator[str]:
    yield f"{'#' * max(2, len(path))} `{' '.join(path)}` {{#{_anchor(path)}}}"
    yield ""
    yield "```text"
    yield f"Usage: {ctx.command_path} {' '.join(command.collect_usage_pieces(ctx))}"  # unwrapped: any $COLUMNS
    yield "```"
    if command.help:
        yield ""
        yield _text(command.help)
    records = [p.get_help_record(ctx) for p in command.params if p.name not in COMPLETION]
    rows = [[code(opts), _text(help_text) or "—"] for opts, help_text in filter(None, records)]
    if rows:
        yield ""
        yield table(("argument or option", "meaning"), rows)
    if hasattr(command, "list_commands"):
        subs = [(p, c) for p, c, _ in _commands(command, ctx, path) if len(p) == len(path) + 1]
        yield ""
        yield table(("command", "what it does"), (
            [f"[`{' '.join(p)}`](#{_anchor(p)})", _text(c.get_short_help_str(limit=120))] for p, c in subs))
    yield ""


def render() -> str:
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="rlbus")
    parts = [
        GENERATED,
        "",
        "# Command line reference",
        "",
        "Every `rlbus` command with its options, as `rlbus COMMAND --help` prints them (generated from the CLI, "
        "`rlbus/cli/app.py`). `rlbus bench`, `sim`, `kafka` and `up` come from the repository's tooling package "
        "(`tools/`, installed by `make venv`).",
        "",
    ]
    for path, command, context in _commands(root, ctx, ("rlbus",)):
        parts += list(_section(path, command, context))
    return "\n".join(parts)
