"""Fixture tasks of the coding environment: the hand-made corpus (two task directories) and a
SWE-bench-style JSONL row over a local git repository built here (base commit = the buggy version, a
later commit on top so the export must pick the right one)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlbus.envs.swe.task import RepoTask, load_tasks
from rlbus.errors import SandboxError
from rlbus.sandbox import find_bwrap

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "swe"
CORPUS = FIXTURES / "corpus"

FIX = """\
diff --git a/counter/__init__.py b/counter/__init__.py
--- a/counter/__init__.py
+++ b/counter/__init__.py
@@ -1,3 +1,3 @@
 def count(items, value):
     \"\"\"How many times ``value`` occurs in ``items``.\"\"\"
-    return sum(1 for x in items if x != value)
+    return sum(1 for x in items if x == value)
"""
TEST_PATCH = (
    "diff --git a/tests/test_counter.py b/tests/test_counter.py\n"
    "--- a/tests/test_counter.py\n"
    "+++ b/tests/test_counter.py\n"
    "@@ -7,3 +7,7 @@ def test_count():\n"
    " \n"
    " def test_empty():\n"
    "     assert count([], 1) == 0\n"
    "+\n"
    "+\n"
    "+def test_missing():\n"
    "+    assert count([2, 3], 1) == 0\n"
)


@pytest.fixture(autouse=True)
def require_bwrap() -> None:
    try:
        find_bwrap()
    except SandboxError as exc:
        pytest.fail(f"{exc} — the coding environment's tests need it (CI installs it).", pytrace=False)


@pytest.fixture(scope="session")
def corpus_tasks() -> dict[str, RepoTask]:
    return {t.task_id: t for t in load_tasks([CORPUS])}


def _git(repo: Path, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(repo), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="session")
def jsonl_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("swe-jsonl")
    repo = root / "counter-repo"
    shutil.copytree(FIXTURES / "jsonl" / "counter", repo)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "buggy")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "counter" / "__init__.py").write_text("raise RuntimeError('HEAD is not the base commit')\n")
    _git(repo, "commit", "-qam", "later work")
    row = {
        "instance_id": "counter-1", "repo": "counter-repo", "base_commit": base,
        "problem_statement": "count() counts the values that differ from `value`.",
        "patch": FIX, "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": json.dumps(["tests/test_counter.py::test_count", "tests/test_counter.py::test_missing"]),
        "PASS_TO_PASS": ["tests/test_counter.py::test_empty"],
    }  # fmt: skip
    path = root / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path
