"""The in-memory coding task, and its two on-disk forms: a Harbor-style task directory and SWE-bench rows.

Both formats load into one `RepoTask` (an adapter at the edge, docs/architecture.md §9.4): where the starting repository
comes from (`Source`), the instruction, the hidden test files (repository path → content), the node ids
that must go from failing to passing and those that must keep passing, the test command, limits and the
reference solution patch. Loading validates everything a run would otherwise trip over later, and every
problem is a `TaskFormatError` naming the file and the field (``toolz-1/task.toml: tests.fail_to_pass``).

Task directory (what `rlbus.taskgen` writes)::

    <id>/instruction.md  task.toml  environment/{repo/ | setup.sh | bug.patch}  tests/…  solution/solution.patch

The hidden tests are the files under ``tests/``, and/or files of the base named in ``[tests] hidden``
(``hidden = ["tests/test_func.py"]``): the generated corpus's tests are its libraries' own, so they are
stored once, in the base archive, and read from it by path.

SWE-bench rows (one JSON object a line): ``instance_id``, ``repo`` (a local directory — with
``base_commit``, a git repository whose commit is exported — or a ``.tar.gz`` archive, relative to the
JSONL file), ``problem_statement``, ``patch`` (the reference fix), ``test_patch`` (adds or changes the
hidden tests; applied at grading time, never shown), ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists, or JSON
strings of lists, as the SWE-bench datasets store them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import tarfile
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlbus.errors import TaskFormatError

DEFAULT_COMMAND = "python -m pytest -q -p no:cacheprovider {tests}"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_COMMAND = re.compile(r"^python3? -m pytest(\s|$)")
_NODE = re.compile(r"^[^\s:]+\.py(::[^\s]+)?$")


@dataclass(frozen=True)
class Limits:
    """Per-task budgets (task.toml ``[limits]``)."""

    agent_timeout_s: float = 600.0
    test_timeout_s: float = 120.0
    cpu_s: int | None = None
    memory_mb: int = 2048
    processes: int = 64
    max_turns: int = 30


@dataclass(frozen=True)
class Source:
    """Where the starting repository comes from; exactly one of ``repo`` / ``base`` / ``setup`` / ``git``.

    ``base`` (a directory or ``.tar.gz``) may come with ``patch`` applied over it; ``git`` is a local git
    repository exported at ``commit``; ``setup`` is a script run once in an empty directory in the
    sandbox."""

    kind: Literal["repo", "base", "git", "setup"]
    path: Path
    patch: str = ""
    commit: str = ""

    def fingerprint(self) -> str:
        """Changes whenever the materialised repository could (paths, commit, patch, file stamps)."""
        h = hashlib.sha256(f"{self.kind}\0{self.path}\0{self.commit}\0{self.patch}".encode())
        if self.kind != "git":
            for p in sorted(self.path.rglob("*")) if self.path.is_dir() else [self.path]:
                if p.is_file():
                    st = p.stat()
                    h.update(
                        f"{p.relative_to(self.path) if p != self.path else ''}\0{st.st_size}\0{st.st_mtime_ns}".encode()
                    )
        return h.hexdigest()[:20]


@dataclass(frozen=True)
class RepoTask:
    """One coding task, whatever format it came from."""

    task_id: str
    instruction: str
    source: Source
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    solution: str
    """The reference fix, a git-format unified diff."""
    hidden_tests: Mapping[str, bytes] = field(default_factory=dict)
    """Repository path → content, written over the repository before the tests run."""
    test_patch: str = ""
    """A diff applied after ``hidden_tests`` are written (SWE-bench's ``test_patch``)."""
    command: str = DEFAULT_COMMAND
    test_env: Mapping[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    origin: str = "hand"
    metadata: Mapping[str, str] = field(default_factory=dict)
    location: str = ""
    """The file or directory it was loaded from (for messages)."""

    @property
    def tests(self) -> tuple[str, ...]:
        return self.fail_to_pass + self.pass_to_pass

    def test_paths(self) -> set[str]:
        """Repository paths the hidden tests occupy: their files and those ``test_patch`` touches."""
        return set(self.hidden_tests) | set(_patch_paths(self.test_patch))

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.task_id}\0{self.source.fingerprint()}".encode()).hexdigest()[:20]


def load_tasks(paths: Iterable[str | Path]) -> list[RepoTask]:
    """Every task under ``paths``: task directories, corpus directories (their task subdirectories, in
    manifest order when there is a ``manifest.json``) and ``.jsonl`` files. Duplicate ids are refused."""
    tasks: list[RepoTask] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file() and path.suffix == ".jsonl":
            tasks += load_jsonl(path)
        elif (path / "task.toml").is_file():
            tasks.append(load_task_dir(path))
        elif path.is_dir():
            tasks += [load_task_dir(d) for d in corpus_task_dirs(path)]
        else:
            raise TaskFormatError(str(path), "not a task directory, corpus directory or .jsonl file")
    seen: dict[str, str] = {}
    for t in tasks:
        if t.task_id in seen:
            raise TaskFormatError(t.location, f"task id {t.task_id!r} also defined by {seen[t.task_id]}")
        seen[t.task_id] = t.location
    return tasks


def corpus_task_dirs(corpus: Path) -> list[Path]:
    manifest = corpus / "manifest.json"
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text())["tasks"]
            return [corpus / str(e["path"]) for e in entries]
        except (ValueError, KeyError, TypeError) as exc:
            raise TaskFormatError(f"{manifest}: tasks", f"not a task list: {exc}") from None
    return sorted(d for d in corpus.iterdir() if (d / "task.toml").is_file())


# -- task directories ------------------------------------------------------------------------------------


def load_task_dir(path: str | Path) -> RepoTask:
    root = Path(path)
    toml_path = root / "task.toml"
    where = str(toml_path)
    try:
        data = tomllib.loads(toml_path.read_text())
    except FileNotFoundError:
        raise TaskFormatError(where, "missing") from None
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(where, f"not TOML: {exc}") from None
    _only(data, {"task", "environment", "tests", "limits", "metadata"}, where, "")
    task = _table(data, "task", where)
    _only(task, {"id", "version", "source"}, where, "task")
    task_id = _str(task, "id", where, "task")
    if task_id != root.name or not _ID.match(task_id):
        raise TaskFormatError(f"{where}: task.id", f"{task_id!r} must equal the directory name {root.name!r}")
    if task.get("version", 1) != 1:
        raise TaskFormatError(f"{where}: task.version", f"{task.get('version')!r} is not supported (1)")
    origin = str(task.get("source", "hand"))
    if origin not in ("generated", "swe-bench", "hand"):
        raise TaskFormatError(f"{where}: task.source", f"{origin!r} is not generated, swe-bench or hand")
    instruction = _read_text(root / "instruction.md")
    solution = _read_text(root / "solution" / "solution.patch")
    tests = _table(data, "tests", where)
    _only(tests, {"command", "fail_to_pass", "pass_to_pass", "env", "hidden"}, where, "tests")
    source = _dir_source(root, data.get("environment", {}), where)
    return RepoTask(
        task_id=task_id,
        instruction=instruction,
        source=source,
        fail_to_pass=_node_ids(tests.get("fail_to_pass"), f"{where}: tests.fail_to_pass", minimum=1),
        pass_to_pass=_node_ids(tests.get("pass_to_pass", []), f"{where}: tests.pass_to_pass", minimum=0),
        solution=_check_patch(solution, str(root / "solution" / "solution.patch")),
        hidden_tests=_hidden_tests(root / "tests", tests.get("hidden"), source, f"{where}: tests.hidden"),
        command=_command(tests.get("command", DEFAULT_COMMAND), f"{where}: tests.command"),
        test_env=_str_map(tests.get("env", {}), f"{where}: tests.env"),
        limits=_limits(data.get("limits", {}), f"{where}: limits"),
        origin=origin,
        metadata={str(k): str(v) for k, v in _table(data, "metadata", where, required=False).items()},
        location=str(root),
    )


def _dir_source(root: Path, env: Any, where: str) -> Source:
    if not isinstance(env, dict):
        raise TaskFormatError(f"{where}: environment", "must be a table")
    _only(env, {"base", "patch", "setup"}, where, "environment")
    if "base" in env:
        base = (root / _str(env, "base", where, "environment")).resolve()
        if not (base.is_dir() or base.name.endswith((".tar.gz", ".tgz"))) or not base.exists():
            raise TaskFormatError(f"{where}: environment.base", f"{base} is not a directory or .tar.gz archive")
        patch = ""
        if "patch" in env:
            patch_path = root / _str(env, "patch", where, "environment")
            patch = _check_patch(_read_text(patch_path), str(patch_path))
        return Source("base", base, patch=patch)
    if "patch" in env:
        raise TaskFormatError(f"{where}: environment.patch", "needs environment.base to apply to")
    setup = root / str(env.get("setup", "environment/setup.sh"))
    repo = root / "environment" / "repo"
    if repo.is_dir() and "setup" not in env:
        return Source("repo", repo)
    if setup.is_file():
        return Source("setup", setup)
    raise TaskFormatError(f"{root}/environment", "needs repo/, setup.sh, or [environment] base in task.toml")


def _hidden_tests(tests_dir: Path, in_base: Any, source: Source, where: str) -> dict[str, bytes]:
    """The files restored at grading: ``[tests] hidden`` names files of the base (a generated task's tests
    are its library's own, byte for byte, so the corpus stores them once, in the base archive), and the
    ``tests/`` directory holds files the base lacks (a hand-written task's); either or both."""
    files: dict[str, bytes] = {}
    if in_base is not None:
        names = _relative_paths(in_base, where)
        if source.kind != "base":
            raise TaskFormatError(where, "names files of the base: needs [environment] base")
        files.update(_base_files(source.path, tuple(names), where))
    if tests_dir.is_dir():
        for p in sorted(tests_dir.rglob("*")):
            if p.is_symlink():
                raise TaskFormatError(str(p), "hidden tests may not be symlinks")
            if p.is_file() and "__pycache__" not in p.parts:
                files[p.relative_to(tests_dir).as_posix()] = p.read_bytes()
    elif in_base is None:
        raise TaskFormatError(str(tests_dir), "missing: the hidden tests live here (or in [tests] hidden)")
    if not files:
        raise TaskFormatError(str(tests_dir), "holds no test files")
    return files


def _base_files(base: Path, names: tuple[str, ...], where: str) -> dict[str, bytes]:
    """``names`` (repository-relative) read from a base directory or ``.tar.gz``; a missing one is an error."""
    if base.is_dir():
        found = {n: (base / n).read_bytes() for n in names if (base / n).is_file()}
    else:
        found = dict(_archive_files(str(base), base.stat().st_mtime_ns, names))
    if missing := [n for n in names if n not in found]:
        raise TaskFormatError(where, f"{missing[0]!r} is not a file of the base {base.name}")
    return found


def _relative_paths(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise TaskFormatError(where, "must be a non-empty list of repository-relative file paths")
    for v in value:
        if v.startswith("/") or ".." in v.split("/") or "\\" in v:
            raise TaskFormatError(where, f"{v!r} is not a repository-relative path")
    return list(value)


@functools.lru_cache(maxsize=16)
def _archive_files(archive: str, _mtime_ns: int, names: tuple[str, ...]) -> tuple[tuple[str, bytes], ...]:
    """Members of a ``.tar.gz`` by name (cached: tasks of one library share their base archive)."""
    wanted, out = set(names), []
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.isfile() and member.name in wanted:
                handle = tar.extractfile(member)
                assert handle is not None
                out.append((member.name, handle.read()))
    return tuple(out)


def _limits(raw: Any, where: str) -> Limits:
    if not isinstance(raw, dict):
        raise TaskFormatError(where, "must be a table")
    known = Limits.__dataclass_fields__
    for key, value in raw.items():
        if key not in known:
            raise TaskFormatError(f"{where}.{key}", f"unknown limit (known: {', '.join(known)})")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise TaskFormatError(f"{where}.{key}", f"{value!r} must be a positive number")
    ints = {"cpu_s", "memory_mb", "processes", "max_turns"}
    values: dict[str, Any] = {k: int(v) if k in ints else float(v) for k, v in raw.items()}
    return Limits(**values)


# -- SWE-bench rows --------------------------------------------------------------------------------------


def load_jsonl(path: str | Path) -> list[RepoTask]:
    file = Path(path)
    tasks = []
    for n, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            where = f"{file}:{n}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise TaskFormatError(where, f"not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise TaskFormatError(where, "a row must be a JSON object")
            tasks.append(_row_task(row, file.parent, where))
    return tasks


def _row_task(row: dict[str, Any], base_dir: Path, where: str) -> RepoTask:
    for key in ("instance_id", "repo", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS"):
        if key not in row:
            raise TaskFormatError(f"{where}: {key}", "missing")
    task_id = _str(row, "instance_id", where, "")
    if not _ID.match(task_id):
        raise TaskFormatError(f"{where}: instance_id", f"{task_id!r} is not a plain id")
    repo = (base_dir / _str(row, "repo", where, "")).resolve()
    commit = str(row.get("base_commit") or "")
    if repo.is_dir():
        if commit and not (repo / ".git").exists():
            raise TaskFormatError(f"{where}: base_commit", f"{repo} is not a git repository")
        source = Source("git", repo, commit=commit) if commit else Source("base", repo)
    elif repo.is_file() and repo.name.endswith((".tar.gz", ".tgz")):
        source = Source("base", repo)
    else:
        raise TaskFormatError(f"{where}: repo", f"{repo} is not a local directory or .tar.gz archive")
    test_patch = _check_patch(_str(row, "test_patch", where, ""), f"{where}: test_patch")
    return RepoTask(
        task_id=task_id,
        instruction=_str(row, "problem_statement", where, ""),
        source=source,
        fail_to_pass=_node_ids(_listish(row["FAIL_TO_PASS"], f"{where}: FAIL_TO_PASS"), f"{where}: FAIL_TO_PASS", 1),
        pass_to_pass=_node_ids(
            _listish(row.get("PASS_TO_PASS", []), f"{where}: PASS_TO_PASS"), f"{where}: PASS_TO_PASS", 0
        ),
        solution=_check_patch(_str(row, "patch", where, ""), f"{where}: patch"),
        test_patch=test_patch,
        command=_command(row.get("test_command", DEFAULT_COMMAND), f"{where}: test_command"),
        origin="swe-bench",
        metadata={k: str(row[k]) for k in ("version", "created_at", "environment_setup_commit") if k in row},
        location=where,
    )


def _listish(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise TaskFormatError(where, "a string must hold a JSON list of node ids") from None
    return value


# -- field checks ----------------------------------------------------------------------------------------


def _only(table: dict[str, Any], allowed: set[str], where: str, prefix: str) -> None:
    for key in table:
        if key not in allowed:
            name = f"{prefix}.{key}" if prefix else key
            raise TaskFormatError(f"{where}: {name}", f"unknown field (allowed: {', '.join(sorted(allowed))})")


def _table(data: dict[str, Any], key: str, where: str, *, required: bool = True) -> dict[str, Any]:
    value = data.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise TaskFormatError(f"{where}: {key}", "missing table" if value is None else "must be a table")
    return value


def _str(table: dict[str, Any], key: str, where: str, prefix: str) -> str:
    value = table.get(key)
    name = f"{prefix}.{key}" if prefix else key
    if not isinstance(value, str) or not value.strip():
        raise TaskFormatError(f"{where}: {name}", f"must be a non-empty string, not {value!r}")
    return value


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TaskFormatError(where, "must be a table of strings")
    return {str(k): v for k, v in value.items()}


def _node_ids(value: Any, where: str, minimum: int) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskFormatError(where, "must be a list of pytest node ids")
    if len(value) < minimum:
        raise TaskFormatError(where, f"needs at least {minimum} node id(s)")
    bad = [v for v in value if not _NODE.match(v)]
    if bad:
        raise TaskFormatError(where, f"{bad[0]!r} is not a pytest node id (path/to/test_x.py::test_name)")
    if len(set(value)) != len(value):
        raise TaskFormatError(where, "lists a node id twice")
    return tuple(value)


def _command(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _COMMAND.match(value) or "{tests}" not in value:
        raise TaskFormatError(where, 'must start with "python -m pytest" and contain {tests} (the grader runs pytest)')
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise TaskFormatError(str(path), "missing") from None
    except UnicodeDecodeError:
        raise TaskFormatError(str(path), "not UTF-8 text") from None


def _check_patch(text: str, where: str) -> str:
    if not text.strip():
        return text
    if "\n+++ " not in "\n" + text and "GIT binary patch" not in text:
        raise TaskFormatError(where, "not a unified diff (no +++ line)")
    return text


def _patch_paths(patch: str) -> list[str]:
    paths = []
    for line in patch.splitlines():
        if line.startswith("+++ ") and not line.startswith("+++ /dev/null"):
            paths.append(line[4:].split("\t")[0].removeprefix("b/"))
        elif line.startswith("--- ") and not line.startswith("--- /dev/null"):
            paths.append(line[4:].split("\t")[0].removeprefix("a/"))
    return sorted(set(paths))
