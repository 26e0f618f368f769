"""The scripted expert: a task's reference patch turned into the tool calls an agent would make.

For every file the solution changes, the expert views it, then edits it — one ``str_replace`` per changed
block (old text widened with context lines until it is unique in the file), ``create`` for new files
(and for a block it cannot make unique), ``bash rm`` for deleted ones — then runs the visible tests
of the failing node ids and submits. The calls are derived from the solution applied to the template, so
replaying them through the real tools reproduces the solution's diff; `rlbus env trajectories` records the
replay as chat-format SFT rows and `rlbus env check` / `rlbus bench swe` use it as the scripted agent.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rlbus.envs.swe.patch import split_patch
from rlbus.envs.swe.task import RepoTask

Call = tuple[str, dict[str, Any]]


def expert_calls(task: RepoTask, base: Path) -> list[Call]:
    """The expert's tool calls for ``task`` starting from the template ``base``."""
    after = _solved_files(task, base)
    calls: list[Call] = [("view", {"path": "."})]
    for path, new in after.items():
        old_path = base / path
        if new is None:
            calls.append(("bash", {"command": f"rm -- '{path}'"}))
            continue
        if not old_path.is_file():
            calls.append(("create", {"path": path, "file_text": new}))
            continue
        old = old_path.read_text()
        calls.append(("view", {"path": path}))
        calls += _edits(path, old, new)
    test_files = sorted({t.split("::")[0] for t in task.fail_to_pass if (base / t.split("::")[0]).is_file()})
    if test_files:
        calls.append(("bash", {"command": "python -m pytest -q -p no:cacheprovider " + " ".join(test_files)}))
    calls.append(("submit", {}))
    return calls


def _solved_files(task: RepoTask, base: Path) -> dict[str, str | None]:
    """Each file the solution touches → its content after the solution (None: deleted)."""
    with tempfile.TemporaryDirectory(prefix="rlbus-expert-") as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(base, work, symlinks=True)
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "-"], input=task.solution.encode(), cwd=work,
            capture_output=True, env={"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": tmp, "HOME": tmp},
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ValueError(f"{task.task_id}: the solution does not apply: {done.stderr.decode()[-300:]}")
        out: dict[str, str | None] = {}
        for section in split_patch(task.solution):
            target = work / section.path
            out[section.path] = target.read_text() if target.is_file() else None
        return out


def _edits(path: str, old: str, new: str) -> list[Call]:
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    calls: list[Call] = []
    current = old
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for group in reversed(list(matcher.get_grouped_opcodes(0))):  # bottom-up keeps earlier line numbers
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        for context in range(0, 8):
            lo, hi = max(0, i1 - context), min(len(a), i2 + context)
            old_block = "".join(a[lo:hi])
            new_block = "".join(a[lo:i1]) + "".join(b[j1:j2]) + "".join(a[i2:hi])
            if old_block and current.count(old_block) == 1:
                calls.append(("str_replace", {"path": path, "old_str": old_block, "new_str": new_block}))
                current = current.replace(old_block, new_block)
                break
        else:
            return [("create", {"path": path, "file_text": new})]
    if current != new:
        return [("create", {"path": path, "file_text": new})]
    return calls
