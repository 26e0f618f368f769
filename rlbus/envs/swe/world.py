"""Repository worlds: a cached template per task, and a writable copy of it in a sandbox per episode.

A task's starting repository is *materialised once* per worker (and per task fingerprint) into
``<cache>/templates/<task>-<hash>/repo`` (`rlbus.envs.swe.runtime.cache_root`): a directory copied, an
archive extracted (``tarfile`` with the ``data`` filter: no absolute paths, links out or devices), a local
git repository exported at ``base_commit`` (``git archive``, which never touches the user's checkout), a
base with ``bug.patch`` applied, or ``setup.sh`` run in the sandbox in an empty directory. It is built
aside and renamed into place, so concurrent workers never see half a template, and made world-readable so
the sandbox uid can copy it.

An episode (`RepoWorld`) is one `Sandbox` whose world directory holds ``repo/`` — a copy of the template
owned by the sandbox uid (`Sandbox.populate`: ``shutil.copytree`` + ``lchown``, no hard links; ``rlbus
bench swe`` measures it against ``cp -R --reflink=auto``) — with the test runtime mounted read-only at
``/opt/rlbus``. Files persist across
turns; every command is its own sandboxed run (no network, rlimits, wall clock), whose processes all die
when it returns; the whole directory is removed when the episode ends.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from rlbus.envs.swe.runtime import GRADER_INNER, INNER, cache_root, grader_dir, runtime_dir, runtime_env
from rlbus.envs.swe.task import RepoTask, Source
from rlbus.errors import SandboxError, TaskFormatError
from rlbus.sandbox import Sandbox, SandboxLimits

REPO = "repo"
"""The repository's world-relative directory (``/sandbox/repo`` inside)."""
_LOCKS: dict[str, asyncio.Lock] = {}


def sandbox_limits(task: RepoTask, *, wall_s: float | None = None) -> SandboxLimits:
    """The per-command limits of a task's sandbox (its ``[limits]``)."""
    wall = wall_s if wall_s is not None else task.limits.test_timeout_s
    cpu = task.limits.cpu_s if task.limits.cpu_s is not None else int(wall) + 5
    return SandboxLimits(
        wall_s=wall, cpu_s=cpu, memory_mb=task.limits.memory_mb, processes=task.limits.processes,
        file_size_mb=64, open_files=1024, output_bytes=256 * 1024,
    )  # fmt: skip


def task_sandbox(task: RepoTask, *, wall_s: float | None = None, grading: bool = False) -> Sandbox:
    """An unopened sandbox with the test runtime mounted and the task's environment variables; with
    ``grading`` the launcher too (an episode's sandbox never has it: `rlbus.envs.swe.runtime`)."""
    extra = [f"/sandbox/{REPO}/{p}" for v in task.test_env.get("PYTHONPATH", "").split(":") if (p := v.strip())]
    env = runtime_env(extra)
    env.update({k: v for k, v in task.test_env.items() if k != "PYTHONPATH"})
    binds = [(str(runtime_dir()), INNER)]
    if grading:
        binds.append((str(grader_dir()), GRADER_INNER))
    return Sandbox(limits=sandbox_limits(task, wall_s=wall_s), binds=binds, env=env)


async def template(task: RepoTask) -> Path:
    """The task's materialised starting repository (built on first use; see the module docstring)."""
    key = f"{task.task_id}-{task.fingerprint()}"
    target = cache_root() / "templates" / key
    lock = _LOCKS.setdefault(key, asyncio.Lock())
    async with lock:
        if not (target / "ready").exists():
            await _materialise(task, target)
    return target / REPO


async def _materialise(task: RepoTask, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        repo = build / REPO
        if task.source.kind == "setup":
            await _run_setup(task, repo)
        else:
            await asyncio.to_thread(_fill, task.source, repo, task.location)
        if task.source.patch:
            await asyncio.to_thread(apply_trusted, repo, task.source.patch, task.location)
        await asyncio.to_thread(_clean_and_open, repo)
        (build / "ready").write_text("")
        os.chmod(build, 0o755)
        try:
            os.rename(build, target)
        except OSError:
            if not (target / "ready").exists():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _fill(source: Source, repo: Path, where: str) -> None:
    if source.kind == "git":
        done = subprocess.run(
            ["git", "-C", str(source.path), "archive", "--format=tar", source.commit],
            capture_output=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise TaskFormatError(f"{where}: base_commit", done.stderr.decode(errors="replace").strip()[:300])
        _extract(io.BytesIO(done.stdout), repo)
    elif source.path.is_dir():
        shutil.copytree(source.path, repo, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    else:
        with source.path.open("rb") as f:
            _extract(f, repo)


def _extract(stream: io.BufferedIOBase | io.BytesIO, repo: Path) -> None:
    """Extract a tar stream (gzip or not) into ``repo``: its entries are the repository's files at the
    archive root (the corpus format; ``git archive`` writes the same)."""
    repo.mkdir(parents=True)
    with tarfile.open(fileobj=stream, mode="r:*") as tar:
        tar.extractall(repo, filter="data")


def apply_trusted(repo: Path, patch: str, where: str) -> None:
    """``git apply`` a corpus patch (trusted input) to a template being built."""
    done = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"], input=patch.encode(), cwd=repo, capture_output=True,
        env={"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": str(repo.parent), "HOME": str(repo.parent)},
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise TaskFormatError(f"{where}: environment.patch", done.stderr.decode(errors="replace").strip()[:300])


async def _run_setup(task: RepoTask, repo: Path) -> None:
    async with task_sandbox(task) as box:
        box.write(f"{REPO}/.rlbus-setup.sh", task.source.path.read_bytes())
        result = await box.run(["/bin/sh", ".rlbus-setup.sh"], cwd=REPO)
        if not result.ok:
            raise TaskFormatError(f"{task.source.path}", f"setup.sh failed: {result.reason}")
        (box.path / REPO / ".rlbus-setup.sh").unlink()
        await asyncio.to_thread(shutil.copytree, box.path / REPO, repo, symlinks=True)


def _clean_and_open(repo: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(repo):
        for d in [d for d in dirnames if d in (".git", "__pycache__")]:
            shutil.rmtree(os.path.join(dirpath, d))
            dirnames.remove(d)
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.stat(path).st_mode & 0o111 else 0o644)


class RepoWorld:
    """One episode's repository in its sandbox; use `open_world`."""

    def __init__(self, task: RepoTask, box: Sandbox, base: Path, reset_s: float) -> None:
        self.deadline = time.monotonic() + task.limits.agent_timeout_s
        """When the session's time (task.toml ``limits.agent_timeout_s``) is up: tools then refuse to run."""
        self.task = task
        self.box = box
        self.base = base
        """The template the episode started from (read-only to the program: never mounted)."""
        self.reset_s = reset_s
        """Seconds the copy took (the episode's reset time)."""

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def repo(self) -> Path:
        """The repository on the host."""
        return self.box.path / REPO


@asynccontextmanager
async def open_world(task: RepoTask, *, command_timeout_s: float | None = None) -> AsyncIterator[RepoWorld]:
    base = await template(task)
    async with task_sandbox(task, wall_s=command_timeout_s) as box:
        start = time.perf_counter()
        await box.populate(base, REPO)
        yield RepoWorld(task, box, base, time.perf_counter() - start)


def ensure_git() -> str:
    path = shutil.which("git")
    if path is None:
        raise SandboxError("the coding environment needs git (Debian package git) to apply patches")
    return path
