"""The bubblewrap sandbox: outcomes, limits, isolation, and refusal when it cannot isolate.

These tests need ``bwrap`` (Debian package ``bubblewrap``) and fail — never skip — without it, so a CI
machine that lost the package cannot pass by running nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rlbus.errors import SandboxError
from rlbus.sandbox import bwrap as sandbox_module
from rlbus.sandbox.bwrap import Sandbox, SandboxLimits, find_bwrap, main, run_file

THIS_FILE = str(Path(__file__).resolve())  # a file of the repository


@pytest.fixture(autouse=True)
def require_bwrap() -> None:
    try:
        find_bwrap()
    except SandboxError as exc:
        pytest.fail(f"{exc} — the sandbox tests need it (CI installs it).", pytrace=False)


@pytest.fixture
async def box() -> AsyncIterator[Sandbox]:
    async with Sandbox(limits=SandboxLimits(wall_s=5, cpu_s=5, memory_mb=256, processes=16)) as b:
        yield b


async def run(box: Sandbox, code: str, **kw: float) -> sandbox_module.SandboxResult:
    box.write_file("main.py", textwrap.dedent(code))
    return await box.run_python("main.py", **kw)  # type: ignore[arg-type]


def live_processes(uid: int) -> list[int]:
    """Pids of non-zombie processes owned by ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry))
    return pids


async def test_ok_program_output_is_captured(box: Sandbox) -> None:
    result = await run(box, "import sys\nprint('hello')\nprint('warn', file=sys.stderr)")
    assert (result.status, result.exit_code) == ("ok", 0)
    assert result.stdout == "hello\n" and result.stderr == "warn\n" and result.wall_s > 0


async def test_stdin_and_world_directory_persist_between_runs(box: Sandbox) -> None:
    first = await run(box, "import sys\nopen('state.txt', 'w').write(sys.stdin.read().upper())", stdin=b"abc")  # type: ignore[arg-type]
    assert first.ok
    second = await run(box, "print(open('/sandbox/state.txt').read(), open('/tmp/state.txt').read())")
    assert second.stdout == "ABC ABC\n"
    assert box.read_file("state.txt") == b"ABC"


async def test_error_exit_reports_the_last_stderr_line(box: Sandbox) -> None:
    result = await run(box, "raise ValueError('boom')")
    assert result.status == "error" and result.exit_code == 1
    assert result.reason == "exit code 1: ValueError: boom"


async def test_infinite_loop_times_out_and_the_tree_is_killed(box: Sandbox) -> None:
    code = """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        while True:
            pass
    """
    result = await run(box, code, timeout_s=1.0)
    assert result.status == "timeout" and result.exit_code is None
    assert "wall-clock limit of 1s" in result.reason
    assert result.wall_s < 10  # killed at the 1 s limit; the rest is start-up on a possibly busy machine
    if box.uid is not None:  # running as root: the sandbox has a uid of its own to look for
        assert live_processes(box.uid) == []


async def test_fork_bomb_is_bounded_by_the_process_limit(box: Sandbox) -> None:
    counted = await run(box, """
        import os, time
        n = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                n += 1
        except OSError as exc:
            print(n, exc.errno)
    """)  # fmt: skip
    forks, errno = counted.stdout.split()
    assert int(forks) < 16 and int(errno) == 11  # EAGAIN from RLIMIT_NPROC
    bomb = await run(box, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout_s=1.0)  # fmt: skip
    assert bomb.status in {"timeout", "killed", "error"} and bomb.reason
    if box.uid is not None:
        assert live_processes(box.uid) == []


async def test_memory_hog_fails_with_memory_error(box: Sandbox) -> None:
    result = await run(box, "blocks = [bytearray(64 * 1024 * 1024) for _ in range(64)]")
    assert result.status == "error" and "MemoryError" in result.reason


async def test_cpu_and_file_size_limits() -> None:
    async with Sandbox(limits=SandboxLimits(cpu_s=1, wall_s=10, file_size_mb=1)) as b:
        cpu = await run(b, "while True: pass")
        assert cpu.status == "killed" and "CPU time limit" in cpu.reason and cpu.wall_s < 9.5
        big = await run(b, "open('big', 'wb').write(b'x' * (2 * 1024 * 1024))")
        assert big.status in {"error", "killed"} and ("File too large" in big.reason or "file size" in big.reason)


async def test_network_is_unreachable_even_to_host_loopback(box: Sandbox) -> None:
    accepted = threading.Event()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(3)
        port = server.getsockname()[1]
        threading.Thread(target=lambda: _accept(server, accepted), daemon=True).start()
        result = await run(box, f"""
            import socket
            for host in ("127.0.0.1", "8.8.8.8"):
                try:
                    socket.create_connection((host, {port}), timeout=2)
                    print(host, "connected")
                except OSError as exc:
                    print(host, type(exc).__name__)
        """)  # fmt: skip
    assert "connected" not in result.stdout
    assert result.stdout.splitlines() == ["127.0.0.1 ConnectionRefusedError", "8.8.8.8 OSError"]
    assert not accepted.is_set()


def _accept(server: socket.socket, accepted: threading.Event) -> None:
    try:
        server.accept()
        accepted.set()
    except OSError:
        pass


async def test_files_outside_the_sandbox_are_invisible(box: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    paths = ["/etc/shadow", "/etc/passwd", "/root", str(secret), THIS_FILE, "/proc/1/root/etc/shadow"]
    result = await run(box, f"""
        import os
        for p in {paths!r}:
            try:
                if os.path.isfile(p):
                    print(p, "READ", open(p).read()[:20])
                else:
                    print(p, "EXISTS" if os.path.exists(p) else "missing")
            except OSError as exc:
                print(p, type(exc).__name__)
        for p in ("/usr/evil", "/evil", "/dev/evil", "/dev/shm/evil"):
            try:
                open(p, "w")
                print(p, "WROTE")
            except OSError as exc:
                print(p, type(exc).__name__)
    """)  # fmt: skip
    assert result.ok, result.stderr
    assert "READ" not in result.stdout and "EXISTS" not in result.stdout and "WROTE" not in result.stdout
    assert "top secret" not in result.stdout


async def test_environment_is_minimal(box: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLBUS_TEST_SECRET", "hunter2")
    result = await run(box, "import os, json; print(json.dumps(dict(os.environ)), open('/proc/1/environ').read())")
    env_text, init_env = result.stdout.split("\n", 1)[0].rsplit("}", 1)
    env = json.loads(env_text + "}")
    assert "RLBUS_TEST_SECRET" not in env and "hunter2" not in init_env  # nor in bwrap's own environment
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}
    assert env["HOME"] == "/sandbox"


async def test_output_is_capped_without_blocking_the_program() -> None:
    async with Sandbox(limits=SandboxLimits(output_bytes=1000)) as b:
        result = await run(b, "import sys\nsys.stdout.write('x' * 500000)\nprint('done', file=sys.stderr)")
    assert result.ok and result.stdout.startswith("x" * 1000) and "499000 bytes dropped" in result.stdout
    assert result.stderr == "done\n"


async def test_read_file_does_not_follow_symlinks(box: Sandbox) -> None:
    await run(box, "import os\nos.symlink('/etc/hostname', 'link')\nopen('plain', 'w').write('ok')")
    assert box.read_file("link") is None
    assert box.read_file("plain") == b"ok"
    with pytest.raises(ValueError):
        box.write_file("../escape", "x")


async def test_readonly_paths_cannot_be_changed_for_that_run(box: Sandbox) -> None:
    """``run(readonly=…)``: the files stay as the worker wrote them — no write, no rename, no new file;
    the next run may write again, and a path through a symlink is refused."""
    box.write("repo/tests/test_x.py", "x = 1\n")
    box.write("repo/lib.py", "y = 2\n")
    script = (
        "import os\n"
        "for act in (lambda: open('repo/tests/test_x.py', 'w'), lambda: os.rename('repo/tests', 'moved'),\n"
        "            lambda: open('repo/tests/new.py', 'w'), lambda: os.unlink('repo/tests/test_x.py')):\n"
        "    try:\n"
        "        act()\n"
        "        print('changed')\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        "open('repo/lib.py', 'a').write('z = 3\\n')\n"
    )
    box.write("try.py", script)
    run = await box.run([box.python, "-B", "try.py"], readonly=["repo/tests"])
    assert run.ok and "changed" not in run.stdout and len(run.stdout.split()) == 4, run
    assert box.read("repo/tests/test_x.py") == b"x = 1\n" and box.read("repo/lib.py") == b"y = 2\nz = 3\n"
    assert (await box.run([box.python, "-c", "open('repo/tests/test_x.py', 'w')"])).ok
    os.symlink("/etc", box.path / "repo" / "link")
    with pytest.raises(SandboxError):
        await box.run(["true"], readonly=["repo/link"])


async def test_cancelling_a_run_kills_it(box: Sandbox) -> None:
    task = asyncio.create_task(run(box, "import time\ntime.sleep(30)"))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if box.uid is not None:
        assert live_processes(box.uid) == []
    assert (await run(box, "print(1)")).stdout == "1\n"  # the worker and the world are fine


async def test_world_directory_is_private_and_removed(tmp_path: Path) -> None:
    async with Sandbox(root=tmp_path) as b:
        path = b.path
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        await run(b, "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d', 0)")
    assert not path.exists()


async def test_refuses_when_bwrap_cannot_create_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bwrap that fails the way it does without user namespaces: nothing runs, the reason is kept."""
    bin_dir = Path(tempfile.mkdtemp())  # reachable by the unprivileged sandbox uid, unlike tmp_path
    os.chmod(bin_dir, 0o755)
    fake = bin_dir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module, "find_bwrap", lambda: str(fake))
    monkeypatch.setattr(sandbox_module, "_probe_results", {})
    with pytest.raises(SandboxError, match="No permissions to creating new namespace"):
        async with Sandbox():
            pass
    program = tmp_path / "p.py"
    program.write_text("print('must not run')")
    result = await asyncio.to_thread(run_file, program, 5)
    assert result.status == "refused" and "refusing" in result.reason and result.stdout == ""
    shutil.rmtree(bin_dir)


def test_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "p.py"
    program.write_text("print(6 * 7)")
    assert main(["run", str(program), "--timeout", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["stdout"] == "42\n" and out["exit_code"] == 0
    assert set(out) == {"status", "exit_code", "reason", "stdout", "stderr", "wall_s"}
    program.write_text("while True: pass")
    assert main(["run", str(program), "--timeout", "0.5"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "timeout"
