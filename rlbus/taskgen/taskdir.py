"""Write generated tasks in the task-directory format (swe-format.md) and keep the corpus manifest.

The `swe` environment reads these directories; this module only writes them, so the layout has one
owner on each side and swe-format.md between them. A generated task does not copy its repository: it
points at a shared base snapshot (``_bases/NAME-VER.tar.gz``, the unchanged release) and carries the bug
as ``environment/bug.patch``, which keeps a corpus of dozens of tasks to a few hundred kilobytes. Base
archives are written byte-for-byte reproducibly (sorted entries, zero mtimes and owners), so regenerating
with the same seed changes nothing in git.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_COMMAND = "python -m pytest -q -p no:cacheprovider {tests}"
MANIFEST = "manifest.json"
BASES = "_bases"
REQUIRED_FILES = ("instruction.md", "task.toml", "environment/bug.patch", "solution/solution.patch")


@dataclass
class GeneratedTask:
    """Everything one task directory holds."""

    id: str
    library: str
    version: str
    base: str
    """The base archive's file name under ``_bases/``."""
    instruction: str
    bug_patch: str
    solution_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    hidden_tests: dict[str, bytes]
    """Repository-relative path → content of the test files (and their conftest.py files) restored at grading;
    all are files of the base archive, so task.toml names them (``[tests] hidden``) instead of copying them."""
    src: str = ""
    metadata: dict[str, str | int | float] = field(default_factory=dict)
    checked: dict[str, Any] = field(default_factory=dict)
    test_timeout_s: int = 120


def write_base(files_root: Path, files: Sequence[str], archive: Path) -> None:
    """A reproducible .tar.gz of ``files`` (repository-relative) with the repository at the archive's root."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            data = (files_root / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    with archive.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(buffer.getvalue())


def _toml_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=True)


def _toml_value(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return _toml_string(value)


def _toml_list(values: Sequence[str]) -> str:
    if not values:
        return "[]"
    return "[\n" + "".join(f"  {_toml_string(v)},\n" for v in values) + "]"


def task_toml(task: GeneratedTask) -> str:
    lines = [
        "[task]",
        f"id = {_toml_string(task.id)}",
        "version = 1",
        'source = "generated"',
        "",
        "[environment]",
        f"base = {_toml_string(f'../{BASES}/{task.base}')}",
        'patch = "environment/bug.patch"',
        "",
        "[tests]",
        f"command = {_toml_string(DEFAULT_COMMAND)}",
        f"fail_to_pass = {_toml_list(task.fail_to_pass)}",
        f"pass_to_pass = {_toml_list(task.pass_to_pass)}",
        f"hidden = {_toml_list(sorted(task.hidden_tests))}",
    ]
    if task.src:
        lines.append(f"env = {{PYTHONPATH = {_toml_string(task.src)}}}")
    lines += ["", "[limits]", f"test_timeout_s = {task.test_timeout_s}", "", "[metadata]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in sorted(task.metadata.items())]
    return "\n".join(lines) + "\n"


def write_task(corpus: Path, task: GeneratedTask) -> Path:
    """Create ``corpus/<id>/`` (replacing an older one of that id)."""
    directory = corpus / task.id
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "environment").mkdir(parents=True)
    (directory / "solution").mkdir()
    (directory / "instruction.md").write_text(task.instruction, encoding="utf-8")
    (directory / "task.toml").write_text(task_toml(task), encoding="utf-8")
    (directory / "environment" / "bug.patch").write_text(task.bug_patch, encoding="utf-8")
    (directory / "solution" / "solution.patch").write_text(task.solution_patch, encoding="utf-8")
    # The hidden tests are files of the base archive, byte for byte: task.toml names them ([tests] hidden).
    return directory


def manifest_entry(task: GeneratedTask) -> dict[str, Any]:
    return {
        "id": task.id,
        "path": task.id,
        "library": task.library,
        "version": task.version,
        "fail_to_pass": len(task.fail_to_pass),
        "pass_to_pass": len(task.pass_to_pass),
        "checked": task.checked,
    }


def read_manifest(corpus: Path) -> dict[str, Any]:
    path = corpus / MANIFEST
    if not path.is_file():
        return {"version": 1, "tasks": []}
    document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return document


def write_manifest(corpus: Path, document: dict[str, Any]) -> None:
    document["tasks"] = sorted(document.get("tasks", []), key=lambda entry: entry["id"])
    text = json.dumps(document, indent=1, sort_keys=False) + "\n"
    (corpus / MANIFEST).write_text(text, encoding="utf-8")


def drop_library(corpus: Path, document: dict[str, Any], library: str) -> int:
    """Remove a library's tasks (directories and manifest entries) before regenerating them; how many."""
    keep, dropped = [], 0
    for entry in document.get("tasks", []):
        if entry.get("library") == library:
            shutil.rmtree(corpus / entry["path"], ignore_errors=True)
            dropped += 1
        else:
            keep.append(entry)
    document["tasks"] = keep
    return dropped
