"""Diffs of repository worlds, and the filter every patch passes before it is graded.

`tree_diff` turns an episode's final repository into a git-format patch against the task's template
(computed on the host, against the template the program never could write, so rewriting ``.git`` or
the history changes nothing). Only regular text files count: symlinks, binaries, files over
``max_file_bytes`` and caches (``.git``, ``__pycache__``, ``.pytest_cache``, ``.hypothesis``) are left out
and listed in the diff's notes — a symlink the agent made never reaches grading.

`filter_patch` splits a patch into per-file sections and keeps only those that may change what the
library *does*, not how its tests are *run*:

    ==========================  ========================================================================
    dropped (with the reason)   why
    ==========================  ========================================================================
    outside the repository      absolute paths, ``..`` components, ``.git/``
    symlinks, binary, renames   mode 120000, ``GIT binary patch``, rename/copy headers
    hidden test paths           the task's test files and anything ``test_patch`` touches (restored anyway)
    test files and directories  ``test_*.py``, ``*_test.py``, anything under ``tests/``, ``test/``, ``testing/``
    test configuration          ``conftest.py``, ``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``,
                                ``noxfile.py``, ``.pytest.ini``
    interpreter start-up hooks  ``sitecustomize.py``, ``usercustomize.py``, ``*.pth``
    runner shadows              any path component named after a runtime module (``pytest``, ``_pytest``,
                                ``pluggy``, ``hypothesis`` …), as a package or a ``.py`` file
    ==========================  ========================================================================

Dropped sections are reported, never silently lost: the reward's metadata lists them.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}
_CONFIG = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py"}
_STARTUP = {"sitecustomize.py", "usercustomize.py"}
_TEST_DIRS = {"tests", "test", "testing"}
RUNNER_MODULES = {
    "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "hypothesis", "_hypothesis_pytestplugin",
    "_hypothesis_globals", "_hypothesis_ftz_detector", "attr", "attrs", "sortedcontainers", "py",
    "exceptiongroup", "tomli", "grader_main", "grader_runner", "grader_guard", "grader_values", "grader_seccomp",
}  # fmt: skip
_HEADER = re.compile(r"^diff --git a/(.*?) b/(.*)$")


@dataclass
class Diff:
    patch: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def tree_diff(base: Path, world: Path, *, max_file_bytes: int = 1 << 20) -> Diff:
    """The git-format patch that turns ``base`` into ``world`` (both repository roots)."""
    notes: list[str] = []
    old, new = _files(base, notes, max_file_bytes, "base"), _files(world, notes, max_file_bytes, "world")
    sections, files = [], []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        section = _section(path, a, b)
        if section is None:
            notes.append(f"{path}: not UTF-8 text, left out")
            continue
        sections.append(section)
        files.append(path)
    return Diff("".join(sections), files, notes)


def _files(root: Path, notes: list[str], max_bytes: int, side: str) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if name.endswith((".pyc", ".pyo")):
                continue
            try:
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                if side == "world":
                    notes.append(f"{rel}: a symlink or unreadable, left out")
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                if st.st_size > max_bytes:
                    notes.append(f"{rel}: larger than {max_bytes} bytes, left out")
                    continue
                out[rel] = (f.read(), 0o755 if st.st_mode & 0o111 else 0o644)
    return out


def _section(path: str, a: tuple[bytes, int] | None, b: tuple[bytes, int] | None) -> str | None:
    try:
        old = a[0].decode() if a else ""
        new = b[0].decode() if b else ""
    except UnicodeDecodeError:
        return None
    if "\0" in old or "\0" in new:
        return None
    head = [f"diff --git a/{path} b/{path}\n"]
    if a is None and b is not None:
        head.append(f"new file mode 100{b[1]:o}\n")
    elif b is None and a is not None:
        head.append(f"deleted file mode 100{a[1]:o}\n")
    elif a is not None and b is not None and a[1] != b[1]:
        head += [f"old mode 100{a[1]:o}\n", f"new mode 100{b[1]:o}\n"]
    if old == new:
        return "".join(head)
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True),
        "a/" + path if a else "/dev/null", "b/" + path if b else "/dev/null", n=3,
    )  # fmt: skip
    body = []
    for line in lines:
        body.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(head + body)


@dataclass(frozen=True)
class Section:
    path: str
    text: str
    problem: str | None = None
    """Why the section is dropped; None when it is kept."""


@dataclass
class Filtered:
    patch: str
    kept: list[str]
    dropped: list[tuple[str, str]]
    """(path, reason) of every section left out."""


def split_patch(patch: str) -> list[Section]:
    """Per-file sections of a git-format (or plain unified) diff, each with the path it changes."""
    chunks: list[list[str]] = []
    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git ") or (line.startswith("--- ") and (not chunks or _has_hunk(chunks[-1]))):
            chunks.append([line])
        elif chunks:
            chunks[-1].append(line)
    sections = []
    for chunk in chunks:
        text = "".join(chunk)
        sections.append(Section(_section_path(chunk), text))
    return sections


def _has_hunk(chunk: list[str]) -> bool:
    return any(line.startswith("@@") for line in chunk)


def _section_path(chunk: list[str]) -> str:
    paths = []
    header = _HEADER.match(chunk[0].rstrip("\n"))
    if header:
        paths += [header.group(1), header.group(2)]
    for line in chunk:
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].rstrip("\n").split("\t")[0]
            if name != "/dev/null":
                paths.append(name[2:] if name[:2] in ("a/", "b/") else name)
    bad = [p for p in paths if not _inside(p)]
    return bad[0] if bad else (paths[-1] if paths else "")


def filter_patch(patch: str, *, protected: set[str] = frozenset()) -> Filtered:  # type: ignore[assignment]
    """Keep the sections that only change library files (see the module docstring's table)."""
    kept_text, kept, dropped = [], [], []
    for section in split_patch(patch):
        problem = _problem(section, protected)
        if problem is None:
            kept_text.append(section.text)
            kept.append(section.path)
        else:
            dropped.append((section.path, problem))
    return Filtered("".join(kept_text), kept, dropped)


def _problem(section: Section, protected: set[str]) -> str | None:
    path, text = section.path, section.text
    if not path or not _inside(path):
        return "outside the repository"
    for line in text.splitlines():
        if line.startswith(("rename from", "rename to", "copy from", "copy to")):
            return "renames and copies are not applied"
        if line.startswith(("new file mode 120", "old mode 120", "new mode 120", "deleted file mode 120")):
            return "symlinks are not applied"
        if line.startswith(("GIT binary patch", "Binary files")):
            return "binary changes are not applied"
        if line.startswith(("+++ ", "--- ")):
            name = line[4:].split("\t")[0]
            if name != "/dev/null" and not _inside(name[2:] if name[:2] in ("a/", "b/") else name):
                return "outside the repository"
    if path in protected:
        return "a hidden test path"
    return protected_kind(path)


def protected_kind(path: str) -> str | None:
    """Why a repository path is the test harness's and never the patch's (tests, test directories, test
    configuration, start-up hooks, runner shadows), or None for library code. The grader trusts the
    template's files of these kinds (`rlbus.envs.swe.grading.grade.trusted_files`): no patch can have changed them."""
    parts = PurePosixPath(path).parts
    name = parts[-1]
    if (name.startswith("test_") and name.endswith(".py")) or name.endswith("_test.py"):
        return "a test file"
    if any(p in _TEST_DIRS for p in parts[:-1]):
        return "under a test directory"
    if name in _CONFIG:
        return "test configuration"
    if name in _STARTUP or name.endswith(".pth"):
        return "an interpreter start-up hook"
    if any(p.removesuffix(".py") in RUNNER_MODULES for p in parts):
        return "shadows a module of the test runner"
    return None


def _inside(path: str) -> bool:
    p = PurePosixPath(path)
    return (
        bool(path)
        and not p.is_absolute()
        and ".." not in p.parts
        and (not p.parts or p.parts[0] != ".git")
        and "\0" not in path
        and "\\" not in path
    )
