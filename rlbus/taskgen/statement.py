"""Problem statements written from the failing tests, as an issue a user would file.

SWE-smith writes its issue texts with a language model from the failing tests; this generator has no model
at hand, so it writes a fixed-shape report from the same evidence — which tests fail, the exception and its
message, the chain of functions the error went through. What it must not do is give the answer away: it
never quotes library source lines (a traceback's code lines would show the mutated line), never names the
mutation kind, and drops any message line that contains the mutated source line. Function names in the
call chain stay, as they would in a real traceback pasted into an issue.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

_MAX_MESSAGE_LINES = 14
_MAX_MESSAGE_CHARS = 1200
_MAX_LISTED = 8
_ADDRESS = re.compile(r"\b0x[0-9a-f]{8,}\b")


def summarise(error: dict[str, Any] | None, *, hidden: Sequence[str] = ()) -> str:
    """``Type: message`` of a probe error, truncated, without lines that contain any of ``hidden``."""
    if not error:
        return "the test fails"
    message = str(error.get("message", "")).strip()
    needles = [h.strip() for h in hidden if len(h.strip()) >= 6]
    lines = [line for line in message.splitlines() if not any(n in line for n in needles)]
    if len(lines) > _MAX_MESSAGE_LINES:
        lines = [*lines[:_MAX_MESSAGE_LINES], "…"]
    text = "\n".join(lines)
    if len(text) > _MAX_MESSAGE_CHARS:
        text = text[:_MAX_MESSAGE_CHARS] + " …"
    text = _ADDRESS.sub("0x…", text)  # object reprs: the address differs every run, the corpus must not
    kind = str(error.get("type", "Error"))
    return f"{kind}: {text}" if text else kind


def call_chain(error: dict[str, Any] | None, *, package_files: Sequence[str]) -> list[str]:
    """Names of the library functions the failure passed through (test frames first, innermost last)."""
    if not error:
        return []
    names: list[str] = []
    for path, _line, function in error.get("frames", []):
        relative = next((f for f in package_files if str(path).endswith("/" + f)), None)
        if relative is None:
            continue
        module = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if module.startswith("src."):
            module = module[4:]
        name = f"{module}.{function}"
        if not names or names[-1] != name:
            names.append(name)
    return names


def write(
    *,
    library: str,
    version: str,
    failing: Sequence[str],
    first_error: dict[str, Any] | None,
    chain: Sequence[str],
    hidden: Sequence[str],
    command: str,
) -> str:
    """The instruction.md text: an issue report from the failing tests' evidence."""
    test_name = failing[0].split("::")[-1].split("[", 1)[0]
    title = f"# Wrong behaviour in `{chain[0]}`" if chain else f"# `{test_name}` fails"
    listed = [f"- `{nodeid}`" for nodeid in failing[:_MAX_LISTED]]
    if len(failing) > _MAX_LISTED:
        listed.append(f"- … and {len(failing) - _MAX_LISTED} more")
    parts = [
        title,
        "",
        f"In this checkout of **{library} {version}** some behaviour is broken: "
        f"{len(failing)} test{'s' if len(failing) != 1 else ''} of the project's own suite fail"
        f"{'s' if len(failing) == 1 else ''}:",
        "",
        *listed,
        "",
        "The first failure ends with:",
        "",
        "```",
        summarise(first_error, hidden=hidden),
        "```",
    ]
    if chain:
        parts += ["", "The error comes out of: " + " → ".join(f"`{name}`" for name in chain)]
    parts += [
        "",
        "Reproduce it from the repository root with:",
        "",
        "```",
        command.replace("{tests}", " ".join(shlex.quote(nodeid) for nodeid in failing[:3])),
        "```",
        "",
        "Please fix the library code so that these tests pass. Do not change the tests: they describe the "
        "intended behaviour, and the other tests of the suite must keep passing.",
        "",
    ]
    return "\n".join(parts)
