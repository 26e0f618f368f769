"""The coding agent's tools — bash, view, str_replace, insert, create, search, submit — bound to one world.

Each tool has a JSON parameters schema (offered natively through the chat template, `rlbus.envs.base.Tool`)
and takes its arguments as a JSON object; in the tagged format a plain-text input is accepted as the
tool's main argument (``bash``'s command, ``view``'s path). Wrong arguments raise `ToolError`, which the
agent loop turns into an ``error: …`` observation: a malformed call never ends or crashes an episode.

``bash`` and ``search`` run in the sandbox (``/bin/bash -c`` / ``grep`` in ``/sandbox/repo``, limits and
wall clock of the world, output truncated with the exit code appended). The file tools work on the host
copy through `Sandbox.read` / `Sandbox.write`, which refuse symlinks on the path, so a link the agent
plants cannot make the worker read or write a host file; they are fast (no process per call).
``submit`` ends the episode; the result is always the repository's final diff, whatever it says. Once
the task's ``agent_timeout_s`` has passed every tool but ``submit`` refuses (and ``bash`` never runs past
it), so a session's sandboxed time is bounded whatever the turn budget.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rlbus.envs.base import Tool
from rlbus.envs.swe.world import REPO, RepoWorld
from rlbus.errors import ToolError

MAX_OUTPUT = 10_000
"""Characters of a tool's output the model sees (head and tail kept)."""


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


_STR = {"type": "string"}
SCHEMAS: dict[str, tuple[str, dict[str, Any], str]] = {
    "bash": ("Run a shell command in the repository root (no network). Returns its output and exit code.",
             _schema({"command": {**_STR, "description": "the bash command"},
                      "timeout": {"type": "number", "description": "seconds (default 60)"}}, ["command"]),
             "command"),
    "view": ("Show a file with line numbers (optionally lines view_range=[start, end]) or list a directory.",
             _schema({"path": {**_STR, "description": "path relative to the repository root"},
                      "view_range": {"type": "array", "items": {"type": "integer"}}}, ["path"]), "path"),
    "str_replace": ("Replace the one occurrence of old_str in a file with new_str.",
                    _schema({"path": _STR, "old_str": _STR, "new_str": _STR}, ["path", "old_str", "new_str"]),
                    "path"),
    "insert": ("Insert new_str after line insert_line of a file (0: at the top).",
               _schema({"path": _STR, "insert_line": {"type": "integer"}, "new_str": _STR},
                       ["path", "insert_line", "new_str"]), "path"),
    "create": ("Create or overwrite a file with file_text.",
               _schema({"path": _STR, "file_text": _STR}, ["path", "file_text"]), "path"),
    "search": ("Search files for a regular expression (grep -rnE); path narrows it to a file or directory.",
               _schema({"pattern": _STR, "path": _STR}, ["pattern"]), "pattern"),
    "submit": ("Finish: your changes to the repository are the answer.", _schema({}, []), ""),
}  # fmt: skip


def repo_tools(world: RepoWorld, *, command_timeout_s: float = 60.0) -> dict[str, Tool]:
    """The tools of one episode, bound to its world."""
    ops: dict[str, Callable[[dict[str, Any]], Awaitable[str]]] = {
        "bash": lambda a: _bash(world, a, command_timeout_s),
        "view": lambda a: _view(world, a),
        "str_replace": lambda a: _str_replace(world, a),
        "insert": lambda a: _insert(world, a),
        "create": lambda a: _create(world, a),
        "search": lambda a: _search(world, a, command_timeout_s),
        "submit": _submit,
    }
    tools = {}
    for name, (description, schema, main) in SCHEMAS.items():
        tools[name] = Tool(name, description, _adapter(world, ops[name], main, schema), parameters=schema,
                           final=name == "submit")  # fmt: skip
    return tools


def _adapter(
    world: RepoWorld, op: Callable[[dict[str, Any]], Awaitable[str]], main: str, schema: Mapping[str, Any]
) -> Callable[[str], Awaitable[str]]:
    async def run(text: str) -> str:
        if world.time_left() <= 0 and op is not _submit:
            raise ToolError(f"the session's {world.task.limits.agent_timeout_s:g}s are up; call submit")
        args = _arguments(text, main)
        for key in schema["required"]:
            if key not in args:
                raise ToolError(f"missing argument {key!r} (required: {', '.join(schema['required'])})")
        unknown = set(args) - set(schema["properties"])
        if unknown:
            raise ToolError(f"unknown argument(s) {', '.join(sorted(unknown))}")
        try:
            return _truncate(await op(args))
        except (OSError, ValueError, TypeError) as exc:  # a path through a planted symlink, a bad name …
            raise ToolError(f"{type(exc).__name__}: {exc}") from None

    return run


def _arguments(text: str, main: str) -> dict[str, Any]:
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
    return {main: text} if main and stripped else {}


def _truncate(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    half = MAX_OUTPUT // 2
    return f"{text[:half]}\n[… {len(text) - MAX_OUTPUT} characters cut …]\n{text[-half:]}"


def _string(args: dict[str, Any], key: str) -> str:
    value = args[key]
    if not isinstance(value, str):
        raise ToolError(f"{key!r} must be a string")
    return value


def _path(args: dict[str, Any]) -> str:
    raw = _string(args, "path").strip()
    path = raw.removeprefix("/sandbox/repo").lstrip("/") if raw.startswith("/sandbox/repo") else raw
    if path.startswith("/") or ".." in path.split("/"):
        raise ToolError(f"path {raw!r} must be inside the repository (relative to its root)")
    return path.rstrip("/") or "."


async def _bash(world: RepoWorld, args: dict[str, Any], default_timeout: float) -> str:
    command = _string(args, "command")
    timeout = args.get("timeout", default_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ToolError("'timeout' must be a positive number of seconds")
    limit = max(0.1, min(float(timeout), default_timeout, world.time_left()))
    result = await world.box.run(["/bin/bash", "-c", command], cwd=REPO, timeout_s=limit)
    output = (result.stdout + result.stderr).rstrip()
    if result.status == "timeout":
        return f"{output}\n[timed out after {limit:g}s; every process was killed]"
    return f"{output}\n[exit code {result.exit_code}]" if output else f"[exit code {result.exit_code}]"


def _read_text(world: RepoWorld, path: str) -> str:
    data = world.box.read(f"{REPO}/{path}")
    if data is None:
        raise ToolError(f"{path}: no such file (or not a regular file)")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ToolError(f"{path}: not a UTF-8 text file") from None


async def _view(world: RepoWorld, args: dict[str, Any]) -> str:
    path = _path(args)
    listing = _listing(world, path)
    if listing is not None:
        return listing
    lines = _read_text(world, path).splitlines()
    start, end = 1, len(lines)
    if "view_range" in args:
        rng = args["view_range"]
        if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng)):
            raise ToolError("'view_range' must be [start, end] (1-based; end -1 for the last line)")
        start, end = rng[0], (len(lines) if rng[1] == -1 else rng[1])
        if not 1 <= start <= max(end, 1) or end > len(lines):
            raise ToolError(f"view_range {rng} is outside the file's {len(lines)} lines")
    body = "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines[start - 1 : end], start=start))
    return body or f"({path} is empty)"


def _listing(world: RepoWorld, path: str) -> str | None:
    """A directory listing two levels deep, or None when ``path`` is not a directory (never via a symlink)."""
    root = world.repo if path == "." else world.repo / path
    try:
        st = os.lstat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or any(os.path.islink(p) for p in _ancestors(world, path)):
        return None
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = os.path.relpath(dirpath, root).count(os.sep) + (0 if dirpath == str(root) else 1)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        rel = os.path.relpath(dirpath, world.repo)
        for name in sorted(filenames):
            entries.append(os.path.normpath(os.path.join(rel, name)))
        if depth >= 2:
            dirnames[:] = []
            entries += [os.path.normpath(os.path.join(rel, d)) + "/ …" for d in sorted(os.listdir(dirpath))
                        if os.path.isdir(os.path.join(dirpath, d)) and not d.startswith(".")]  # fmt: skip
        if len(entries) > 400:
            break
    return "\n".join(entries[:400]) or f"({path} is empty)"


def _ancestors(world: RepoWorld, path: str) -> list[str]:
    parts = [] if path == "." else path.split("/")
    return [str(world.repo.joinpath(*parts[: i + 1])) for i in range(len(parts))]


async def _str_replace(world: RepoWorld, args: dict[str, Any]) -> str:
    path, old, new = _path(args), _string(args, "old_str"), _string(args, "new_str")
    text = _read_text(world, path)
    count = text.count(old) if old else 0
    if count != 1:
        raise ToolError(f"old_str occurs {count} times in {path}; it must occur exactly once")
    world.box.write(f"{REPO}/{path}", text.replace(old, new))
    line = text[: text.index(old)].count("\n") + 1
    return f"{path}: replaced 1 occurrence at line {line}"


async def _insert(world: RepoWorld, args: dict[str, Any]) -> str:
    path, new = _path(args), _string(args, "new_str")
    after = args["insert_line"]
    lines = _read_text(world, path).splitlines(keepends=True)
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= len(lines):
        raise ToolError(f"insert_line must be an integer in 0..{len(lines)}")
    if lines and not lines[-1].endswith("\n") and after == len(lines):
        lines[-1] += "\n"
    lines[after:after] = [new if new.endswith("\n") else new + "\n"]
    world.box.write(f"{REPO}/{path}", "".join(lines))
    return f"{path}: inserted {new.count(chr(10)) + 1} line(s) after line {after}"


async def _create(world: RepoWorld, args: dict[str, Any]) -> str:
    path, text = _path(args), _string(args, "file_text")
    try:
        world.box.write(f"{REPO}/{path}", text)
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot write {path}: {exc}") from None
    return f"{path}: wrote {len(text.encode())} bytes"


async def _search(world: RepoWorld, args: dict[str, Any], limit_s: float) -> str:
    pattern = _string(args, "pattern")
    where = _path(args) if "path" in args else "."
    argv = ["grep", "-rnIE", "--exclude-dir=.git", "--exclude-dir=__pycache__", "-m", "50", "-e", pattern, "--", where]
    result = await world.box.run(argv, cwd=REPO, timeout_s=limit_s)
    if result.exit_code == 1:
        return f"no matches for {pattern!r}"
    if result.exit_code != 0:
        raise ToolError(f"search failed: {result.stderr.strip()[:300] or result.reason}")
    lines = result.stdout.splitlines()
    more = f"\n[{len(lines) - 200} more lines]" if len(lines) > 200 else ""
    return "\n".join(lines[:200]) + more


async def _submit(args: dict[str, Any]) -> str:
    return "submitted"
