"""Run untrusted programs — model-written code, hidden tests, agent tool calls — inside bubblewrap.

The sandbox is a security boundary, so it is built on a well-kept isolation tool rather than by hand
(docs/architecture.md §6): bubblewrap (``bwrap``, Debian package ``bubblewrap``) creates fresh user, PID,
mount, network, IPC, UTS and cgroup namespaces. Inside, the program sees:

    ==============  ==============================================================================
    path            what
    ==============  ==============================================================================
    /usr            the host's /usr, read-only (interpreter and libraries)
    /bin /lib …     the host's merged-/usr symlinks (or read-only binds on split-/usr systems)
    /proc /dev      a fresh procfs for the new PID namespace, a minimal devtmpfs
    /sandbox        the world directory: the only writable path, private to one episode
    /tmp            a symlink to /sandbox
    ==============  ==============================================================================

The root and /dev are bwrap's tmpfs mounts, remounted read-only once set up, so nothing outside /sandbox
can be written — not even to memory.

Nothing else exists: no /etc, /home, /root, no repository, no host sockets. The network namespace has only
a loopback interface, so every connection fails. The environment is cleared (``--clearenv``) and set to
PATH/HOME/LANG/TMPDIR only. Nested user namespaces are disabled, the process starts a new session (no
terminal injection), and it dies with its parent.

Resource limits are rlimits applied by ``prlimit`` *inside* the namespaces: CPU seconds (SIGXCPU, then
SIGKILL a second later), address space, file size, processes, open files, no core dumps. Wall-clock time is
enforced by the worker: bwrap runs in its own process group, which is SIGKILLed at the deadline; bwrap's
``--die-with-parent`` then kills the PID namespace's init, and the kernel kills every process left in it.

Why the worker drops to an unprivileged uid when it runs as root: the kernel never enforces RLIMIT_NPROC
for the real root user, so a fork bomb would be bounded only by the wall clock. Each open `Sandbox` takes
a uid from ``uid_range`` (default 65000–65533, Debian's reserved block) that no other sandbox of this
process holds, and bwrap runs as that uid. A non-root worker runs bwrap as itself.

Outcomes (`SandboxResult.status`):

    =========  ===================================================================================
    ok         exit code 0
    error      non-zero exit code; ``reason`` is the last line of stderr (``MemoryError`` …)
    killed     ended by a signal: CPU limit (SIGXCPU/SIGKILL), file size limit (SIGXFSZ), crash
    timeout    the wall-clock limit was reached and the process tree was killed
    refused    the sandbox could not be set up (`run_file` only; `Sandbox` raises SandboxError)
    =========  ===================================================================================

A sandbox that cannot isolate refuses: when bwrap is missing or cannot create namespaces (no unprivileged
user namespaces, a seccomp profile that forbids ``unshare``), `Sandbox` raises `SandboxError` with bwrap's
reason. It never falls back to running the program unsandboxed.

Nested worlds (the coding environment, `rlbus.envs.swe`): `write` / `read` take repository-relative
paths and walk them one component at a time with ``O_NOFOLLOW`` (a symlink anywhere on the path is
refused, so the program cannot point the worker at a host file); `populate` copies a template directory
into the world (as the sandbox uid, so the program owns its copy); ``binds`` mounts extra host directories
read-only at fixed inner paths (the test runtime), ``env`` adds variables, and `run` takes an inner
``cwd`` and world paths to mount read-only over themselves for that run (``readonly``: the grader's
tests). Each `run` is its own PID namespace: a background process a command starts dies when that
command returns, so nothing outlives a tool call, let alone the episode.

Known limits: without a delegated cgroup, memory is bounded per process (address space × processes) and
the world directory's total size is not capped (each file is, by RLIMIT_FSIZE, and CPU time bounds the
write rate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from rlbus.errors import SandboxError

Status = Literal["ok", "error", "timeout", "killed", "refused"]

#: Where the world directory appears inside the sandbox.
SANDBOX_DIR = "/sandbox"
#: uid/gid the program has inside its user namespace.
INNER_ID = 1000
_INNER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SANDBOX_DIR,
    "TMPDIR": SANDBOX_DIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}
_HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
_PRLIMIT = "/usr/bin/prlimit"
_MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-run resource limits."""

    wall_s: float = 10.0
    """Wall-clock seconds before the whole process tree is killed (status ``timeout``)."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL one second later."""
    memory_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS); allocations beyond it fail (MemoryError)."""
    file_size_mb: int = 16
    """Largest file a process may write, in MiB (RLIMIT_FSIZE; SIGXFSZ beyond it)."""
    processes: int = 32
    """Processes and threads in the sandbox, bwrap's init included (RLIMIT_NPROC)."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = 64 * 1024
    """Bytes of stdout and of stderr kept; the rest is read and dropped so the program never blocks."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "processes", "open_files", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class SandboxResult:
    """How one sandboxed run ended; ``exit_code`` is None when it was killed at the deadline or refused."""

    status: Status
    exit_code: int | None
    reason: str
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class Sandbox:
    """One episode's world: a private directory and the sandboxed processes run in it.

    ``async with Sandbox() as box:`` creates the directory (and takes a uid when running as root);
    leaving the block removes it. `run` is cancellation-safe: a cancelled run kills its process tree.
    """

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        root: str | os.PathLike[str] | None = None,
        python: str | None = None,
        uid_range: range = range(65000, 65534),
        binds: Sequence[tuple[str, str]] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.binds = tuple(binds)
        """(host path, inner path) pairs mounted read-only."""
        self.env = dict(env or {})
        """Variables set inside besides PATH/HOME/LANG/TMPDIR (these may be overridden)."""
        self._root = Path(root) if root is not None else None
        self._python = python
        self._uid_range = uid_range
        self._path: Path | None = None
        self._bwrap = ""
        self.uid: int | None = None
        """The host uid bwrap runs as (root workers only); None when bwrap runs as the worker's own uid."""

    @property
    def path(self) -> Path:
        """The world directory on the host (``/sandbox`` inside)."""
        if self._path is None:
            raise RuntimeError("the sandbox is not open; use `async with Sandbox() as box`")
        return self._path

    @property
    def python(self) -> str:
        """The interpreter used by `run_python` (the same path inside the sandbox and on the host)."""
        return self._python or find_python()

    async def __aenter__(self) -> Self:
        self._bwrap = find_bwrap()
        self.uid = _UIDS.acquire(self._uid_range) if os.geteuid() == 0 else None
        try:
            await asyncio.to_thread(probe, self._bwrap, self.uid)
            self._path = await asyncio.to_thread(_make_world, self._root, self.uid)
        except BaseException:
            self._release()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        path, self._path = self._path, None
        if path is not None:
            await asyncio.to_thread(_remove_tree, path)
        self._release()

    def _release(self) -> None:
        if self._path is not None:
            _remove_tree(self._path)
            self._path = None
        if self.uid is not None:
            _UIDS.release(self.uid)
            self.uid = None

    def write_file(self, name: str, data: str | bytes) -> None:
        """Create or replace a top-level file of the world directory (never following a symlink)."""
        payload = data.encode() if isinstance(data, str) else data
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(self.path / _check_name(name), flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)

    def read_file(self, name: str, *, max_bytes: int = _MIB) -> bytes | None:
        """A top-level regular file written by the program, or None if absent or not a regular file.

        The program controls the directory, so a symlink (to /etc/shadow, say) is refused, not followed.
        """
        try:
            fd = os.open(self.path / _check_name(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(max_bytes)

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        """Create or replace the file at a world-relative ``path`` (``repo/pkg/mod.py``), creating parent
        directories; no component may be a symlink. Owned by the sandbox uid when there is one."""
        payload = data.encode() if isinstance(data, str) else data
        parts = _split_path(path)
        dir_fd = _open_dirs(self.path, parts[:-1], create=True, uid=self.uid)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            fd = os.open(parts[-1], flags, mode, dir_fd=dir_fd)
            if self.uid is not None:
                os.fchown(fd, self.uid, self.uid)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
        finally:
            os.close(dir_fd)

    def read(self, path: str, *, max_bytes: int = 16 * _MIB) -> bytes | None:
        """The regular file at a world-relative ``path``, or None if absent, not regular, or reached
        through a symlink."""
        parts = _split_path(path)
        try:
            dir_fd = _open_dirs(self.path, parts[:-1], create=False, uid=None)
        except OSError:
            return None
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            return None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(max_bytes)

    async def populate(self, template: str | os.PathLike[str], dest: str, *, method: CopyMethod = "copytree") -> float:
        """Copy the directory ``template`` to the world-relative ``dest``, owned by the program (`copy_tree`);
        returns the seconds it took."""
        target = self.path / Path(*_split_path(dest))
        if target.exists() or target.is_symlink():
            raise ValueError(f"{dest!r} already exists in the world")
        start = time.perf_counter()
        await asyncio.to_thread(copy_tree, Path(template), target, self.uid, method)
        return time.perf_counter() - start

    async def run_python(
        self, script: str, *, args: Sequence[str] = (), timeout_s: float | None = None, stdin: bytes | None = None
    ) -> SandboxResult:
        """Run ``script`` (a file name in the world directory) with the sandbox's Python."""
        return await self.run([self.python, "-B", _check_name(script), *args], timeout_s=timeout_s, stdin=stdin)

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        readonly: Sequence[str] = (),
    ) -> SandboxResult:
        """Run ``argv`` inside the sandbox with cwd ``/sandbox`` (or the world-relative ``cwd``); the
        outcome is data, never an exception. ``readonly``: world-relative files or directories this run
        may not change (bind-mounted read-only over themselves: no write, rename, unlink or new file).

        Raises SandboxError only when the sandbox itself cannot be set up.
        """
        limits = self.limits if timeout_s is None else replace(self.limits, wall_s=timeout_s)
        inner_cwd = SANDBOX_DIR if cwd is None else "/".join((SANDBOX_DIR, *_split_path(cwd)))
        extra = [*_bind_args(self.binds), *self._readonly_args(readonly), "--chdir", inner_cwd]
        for name, value in {**self.env, **(env or {})}.items():
            extra += ["--setenv", name, value]
        status_r, status_w = os.pipe()
        try:
            command = [self._bwrap, *_bwrap_args(self.path, status_w, extra), *_prlimit_args(limits), *argv]
            return await _execute(command, limits, status_r, status_w, self.uid, stdin)
        finally:
            os.close(status_r)


    def _readonly_args(self, paths: Sequence[str]) -> list[str]:
        """``--ro-bind`` of each world path over itself; a path reached through a symlink is refused (the
        program owns the world and could point it at a host file)."""
        args: list[str] = []
        for path in paths:
            parts = _split_path(path)
            dir_fd = _open_dirs(self.path, parts[:-1], create=False, uid=None)
            try:
                st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            finally:
                os.close(dir_fd)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise SandboxError(f"{path} is not a regular file or directory; it cannot be made read-only")
            host = str(self.path.joinpath(*parts))
            args += ["--ro-bind", host, "/".join((SANDBOX_DIR, *parts))]
        return args


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(
            "bubblewrap is not installed (no `bwrap` on PATH); install the Debian package `bubblewrap`."
            " Refusing to run untrusted code without a sandbox."
        )
    return path


def find_python() -> str:
    """A Python interpreter under /usr, the only system tree the sandbox can see."""
    versioned = sorted(glob.glob("/usr/bin/python3.[0-9]*"), reverse=True)
    for candidate in (*_PYTHONS, *versioned):
        if os.access(candidate, os.X_OK) and not candidate.endswith("-config"):
            return candidate
    raise SandboxError(f"no Python interpreter under /usr (looked for {', '.join(_PYTHONS)}); install `python3`")


_probe_results: dict[tuple[str, bool], str | None] = {}


def probe(bwrap: str, uid: int | None) -> None:
    """Check once per process that bwrap can build the full sandbox; raise SandboxError with why not."""
    key = (bwrap, uid is not None)
    if key not in _probe_results:
        _probe_results[key] = _probe_once(bwrap, uid)
    reason = _probe_results[key]
    if reason is not None:
        raise SandboxError(reason)


def _probe_once(bwrap: str, uid: int | None) -> str | None:
    if not os.access(_PRLIMIT, os.X_OK):
        return f"{_PRLIMIT} is missing (Debian package util-linux); the sandbox cannot set resource limits"
    with tempfile.TemporaryDirectory(prefix="rlbus-sandbox-probe-") as tmp:
        if uid is not None:
            os.chown(tmp, uid, uid)
        command = [bwrap, *_bwrap_args(Path(tmp), None), *_prlimit_args(SandboxLimits()), "/usr/bin/true"]
        ids: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        try:
            done = subprocess.run(command, capture_output=True, timeout=30, env=_HOST_ENV, check=False, **ids)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"bubblewrap could not be started: {exc}"
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip() or f"exit code {done.returncode}"
        return (
            f"bubblewrap cannot create the sandbox's namespaces here ({detail}); refusing to run untrusted"
            " code unsandboxed. Unprivileged user namespaces must be allowed (sysctl"
            " kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0, no seccomp/AppArmor block)."
        )
    return None


def _bwrap_args(world: Path, status_fd: int | None, extra: Sequence[str] = ()) -> list[str]:
    args = [
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid", str(INNER_ID),
        "--gid", str(INNER_ID),
        "--hostname", "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--ro-bind", "/usr", "/usr",
        *_top_level_args(),
        "--proc", "/proc",
        "--dev", "/dev",
        "--bind", str(world), SANDBOX_DIR,
        "--symlink", SANDBOX_DIR, "/tmp",
        "--remount-ro", "/dev",
    ]  # fmt: skip
    if "--chdir" not in extra:
        args += ["--chdir", SANDBOX_DIR]
    for name, value in _INNER_ENV.items():
        args += ["--setenv", name, value]
    args += [*extra, "--remount-ro", "/"]  # extra binds need the root writable while they are made
    if status_fd is not None:
        args += ["--json-status-fd", str(status_fd)]
    return args


def _top_level_args() -> list[str]:
    """Mirror /bin, /lib … as the host has them: symlinks into /usr (merged /usr) or read-only binds."""
    args: list[str] = []
    for name in _TOP_LEVEL:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    return args


def _bind_args(binds: Sequence[tuple[str, str]]) -> list[str]:
    args: list[str] = []
    for host, inner in binds:
        if not inner.startswith("/") or inner.startswith((SANDBOX_DIR, "/proc", "/dev", "/usr")):
            raise ValueError(f"cannot bind over {inner!r}")
        args += ["--ro-bind", host, inner]
    return args


def _split_path(path: str) -> list[str]:
    """A world-relative path's components; absolute paths, ``..``, empty names and NUL are refused."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or path.startswith("/") or "\0" in path or any(p == ".." for p in parts):
        raise ValueError(f"{path!r} is not a relative path inside the sandbox directory")
    return parts


def _open_dirs(root: Path, parts: Sequence[str], *, create: bool, uid: int | None) -> int:
    """An fd of ``root/parts…``, each component opened with O_NOFOLLOW (created when ``create``)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                if uid is not None:
                    os.chown(part, uid, uid, dir_fd=fd, follow_symlinks=False)
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


CopyMethod = Literal["copytree", "cp"]


def copy_tree(source: Path, target: Path, uid: int | None, method: CopyMethod = "copytree") -> None:
    """Copy the directory ``source`` to ``target`` (not existing yet), owned by ``uid`` when given.

    Modes and times are kept, symlinks are copied as symlinks, hard links become separate files (the
    program can never write through to the source). ``copytree``: `shutil.copytree` and an ``lchown``
    pass, in this process; ``cp``: ``cp -R --reflink=auto`` run as ``uid`` (a reflink on filesystems that
    have them). Measured by ``rlbus bench swe`` (bench/RESULTS.md); on ext4 ``copytree`` is faster for
    small repositories (no process to start) and about even at a few hundred files, so it is the default.
    Raises SandboxError when the copy fails."""
    if method == "copytree":
        try:
            shutil.copytree(source, target, symlinks=True)
            if uid is not None:
                for dirpath, dirnames, filenames in os.walk(target):
                    os.lchown(dirpath, uid, uid)
                    for name in (*dirnames, *filenames):
                        os.lchown(os.path.join(dirpath, name), uid, uid)
        except OSError as exc:
            raise SandboxError(f"copying {source} into the world failed: {exc}") from exc
        return
    command = ["cp", "-R", "--no-dereference", "--preserve=mode,timestamps", "--reflink=auto", "--",
               str(source), str(target)]  # fmt: skip
    ids: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    done = subprocess.run(command, capture_output=True, env=_HOST_ENV, check=False, **ids)
    if done.returncode != 0:
        raise SandboxError(f"copying {source} into the world failed: {done.stderr.decode(errors='replace')[:300]}")


def _prlimit_args(limits: SandboxLimits) -> list[str]:
    return [
        _PRLIMIT,
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_mb * _MIB}",
        f"--fsize={limits.file_size_mb * _MIB}",
        f"--nproc={limits.processes}",
        f"--nofile={limits.open_files}",
        "--core=0",
        "--",
    ]


async def _execute(
    command: list[str], limits: SandboxLimits, status_r: int, status_w: int, uid: int | None, stdin: bytes | None
) -> SandboxResult:
    ids: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_HOST_ENV,
            pass_fds=(status_w,),
            start_new_session=True,
            **ids,
        )
    except OSError as exc:
        raise SandboxError(f"bubblewrap could not be started: {exc}") from exc
    finally:
        os.close(status_w)
    out, err, status = _Capture(limits.output_bytes), _Capture(limits.output_bytes), _StatusReader(status_r)
    timed_out = await _supervise(proc, stdin, out, err, status, limits.wall_s)
    wall = time.monotonic() - start
    outcome, code, reason = _classify(proc.returncode, status.read(), timed_out, err.text(), limits)
    return SandboxResult(outcome, code, reason, out.text(), err.text(), round(wall, 4))


async def _supervise(
    proc: asyncio.subprocess.Process,
    stdin: bytes | None,
    out: _Capture,
    err: _Capture,
    status: _StatusReader,
    wall_s: float,
) -> bool:
    """Feed stdin, drain both pipes, wait for exit; kill the tree at the deadline. True if it timed out."""
    assert proc.stdout is not None and proc.stderr is not None
    readers = [asyncio.create_task(out.drain(proc.stdout)), asyncio.create_task(err.drain(proc.stderr))]
    timed_out = False
    try:
        async with asyncio.timeout(wall_s):
            await _feed(proc, stdin)
            await proc.wait()
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:
            await _kill_tree(proc, status)
        _, pending = await asyncio.wait(readers, timeout=2.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return timed_out


async def _feed(proc: asyncio.subprocess.Process, stdin: bytes | None) -> None:
    if stdin is None or proc.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(stdin)
        await proc.stdin.drain()
        proc.stdin.close()


async def _kill_tree(proc: asyncio.subprocess.Process, status: _StatusReader) -> None:
    """SIGKILL the sandbox's init, let bwrap reap it and exit; then make sure bwrap's group is gone.

    The init of a PID namespace takes every process of the namespace with it when it dies, so killing
    bwrap's ``child-pid`` ends the whole tree, double-forked daemons included, and bwrap (its parent)
    reaps it instead of leaving an orphan. If the sandbox never started, or bwrap does not exit,
    the process group is killed; ``--die-with-parent`` then kills the init too. Not ``proc.kill()``:
    Popen.send_signal polls first and may reap the child behind asyncio's child watcher.
    """
    child = status.read().get("child-pid")
    if isinstance(child, int):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
    if isinstance(child, int):
        await _wait_gone(child, deadline_s=5.0)


async def _wait_gone(pid: int, *, deadline_s: float) -> None:
    """Poll until ``pid`` has exited (gone, or a zombie waiting for its reaper)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _process_state(pid) in (None, "Z", "X"):
            return
        await asyncio.sleep(0.01)


def _process_state(pid: int) -> str | None:
    """The state letter from /proc/PID/stat (procfs reads do not block), or None if the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class _Capture:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.data)
            self.data += chunk[:room]
            self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        return text + (f"\n[… {self.dropped} bytes dropped]" if self.dropped else "")


class _StatusReader:
    """bwrap's --json-status-fd documents (``child-pid`` once set up, ``exit-code`` at the end), merged."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._raw = b""

    def read(self) -> dict[str, Any]:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._fd, 65536):
                self._raw += chunk
        merged: dict[str, Any] = {}
        decoder, text, pos = json.JSONDecoder(), self._raw.decode(errors="replace"), 0
        while (pos := _skip_space(text, pos)) < len(text):
            try:
                doc, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break
            if isinstance(doc, dict):
                merged.update(doc)
        return merged


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _classify(
    returncode: int | None, status: dict[str, Any], timed_out: bool, stderr: str, limits: SandboxLimits
) -> tuple[Status, int | None, str]:
    if timed_out:
        return "timeout", None, f"wall-clock limit of {limits.wall_s:g}s exceeded; process tree killed"
    if "child-pid" not in status:
        raise SandboxError(f"bubblewrap could not set up the sandbox: {_last_line(stderr) or returncode}")
    code = int(status.get("exit-code", returncode if returncode is not None else -1))
    if code == 0:
        return "ok", 0, "exited normally"
    if code > 128 and (name := _signal_name(code - 128)) is not None:
        return "killed", code, _signal_reason(name, limits)
    return "error", code, f"exit code {code}: {_last_line(stderr) or 'no stderr'}"


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _signal_reason(name: str, limits: SandboxLimits) -> str:
    if name == "SIGXCPU":
        return f"CPU time limit of {limits.cpu_s}s exceeded (SIGXCPU)"
    if name == "SIGXFSZ":
        return f"file size limit of {limits.file_size_mb} MiB exceeded (SIGXFSZ)"
    if name == "SIGKILL":
        return f"killed by SIGKILL (CPU hard limit of {limits.cpu_s + 1}s or out of memory)"
    return f"killed by {name}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def _check_name(name: str) -> str:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name in the sandbox directory")
    return name


def _make_world(root: Path | None, uid: int | None) -> Path:
    path = Path(tempfile.mkdtemp(prefix="rlbus-sandbox-", dir=root))
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _remove_tree(path: Path) -> None:
    """Remove a world directory even if the program made parts of it unreadable (chmod 000)."""

    def unlock(_func: Any, failed: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(Path(failed).parent, 0o700)
            os.chmod(failed, 0o700)
        with contextlib.suppress(OSError):
            if Path(failed).is_dir() and not Path(failed).is_symlink():
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    shutil.rmtree(path, onerror=unlock)


class _UidPool:
    """Hands out host uids so concurrently open sandboxes of this process never share one."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def acquire(self, uids: range) -> int:
        free = [u for u in uids if u not in self._used]
        if not free:
            raise SandboxError(f"all {len(uids)} sandbox uids in {uids} are in use")
        uid = random.choice(free)
        self._used.add(uid)
        return uid

    def release(self, uid: int) -> None:
        self._used.discard(uid)


_UIDS = _UidPool()


async def run_file_async(path: str | os.PathLike[str], timeout_s: float = 10.0) -> SandboxResult:
    """Run one Python file in a fresh sandbox; a sandbox that cannot be built gives status ``refused``."""
    source = await asyncio.to_thread(Path(path).read_bytes)
    try:
        async with Sandbox(limits=SandboxLimits(wall_s=timeout_s)) as box:
            box.write_file("main.py", source)
            return await box.run_python("main.py")
    except SandboxError as exc:
        return SandboxResult("refused", None, str(exc), "", "", 0.0)


def run_file(path: str | os.PathLike[str], timeout_s: float = 10.0) -> SandboxResult:
    """Blocking form of `run_file_async` for command-line use (starts its own event loop)."""
    return asyncio.run(run_file_async(path, timeout_s))


def main(argv: Sequence[str] | None = None) -> int:
    """``sandbox run FILE.py [--timeout S]``: print the result as JSON; exit 0 ok, 1 failed, 2 refused."""
    parser = argparse.ArgumentParser(prog="rlbus sandbox", description="Run a Python file in the rlbus sandbox.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run FILE.py sandboxed and print the outcome as JSON")
    run.add_argument("file", type=Path)
    run.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit in seconds")
    options = parser.parse_args(argv)
    if not options.file.is_file():
        parser.error(f"{options.file} is not a file")
    result = run_file(options.file, options.timeout)
    print(result.to_json())
    return {"ok": 0, "refused": 2}.get(result.status, 1)


if __name__ == "__main__":
    sys.exit(main())
