"""Unified diffs between two versions of a file, and applying them the way the grader does.

A task stores its bug as ``environment/bug.patch`` over a shared base snapshot and its fix as
``solution/solution.patch``; both are git-style unified diffs (``diff --git a/P b/P``), the format
swe-format.md fixes for the `swe` environment. The solution is the bug's reverse by construction:
`diff(mutated, original)`. `apply` uses GNU patch, a tool the grader's side has too, so validation
exercises the same path an agent's patch takes.
"""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path

from rlbus.errors import GenerateError


def diff(path: str, old: str, new: str, *, context: int = 3) -> str:
    """A git-style unified diff turning ``old`` into ``new`` for the repository-relative ``path``."""
    if not old.endswith("\n") or not new.endswith("\n"):
        raise GenerateError(f"{path}: cannot diff a file without a final newline")
    body = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=context
    )
    text = "".join(body)
    return f"diff --git a/{path} b/{path}\n{text}" if text else ""


def apply(repo: Path, patch: str) -> None:
    """Apply ``patch`` in ``repo`` with ``patch -p1``; GenerateError with patch's output if it does not fit."""
    done = subprocess.run(
        ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "--quiet"],
        input=patch, cwd=repo, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    if done.returncode != 0:
        raise GenerateError(f"patch does not apply in {repo}: {(done.stdout + done.stderr).strip()[-500:]}")
