"""The sandbox escape suite: hostile answers run exactly as the ``python_fn`` reward runs an answer, and
whether the sandbox contained each.

Each attempt goes through `run_hidden_tests` with the task's own limits and is judged by what the sandbox
reported *and* by checks on the host, since a sandbox that merely says "error" proves nothing: the TCP and
abstract-socket listeners saw no connection, the files were not created, no process outlived its sandbox,
the worker and a sibling sandbox survived kill attempts, planted secrets never came back. ``rlbus bench
sandbox`` runs it before its throughput figures (`rlbus_tools.bench.sandbox`); the unit tests run it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import os
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rlbus
from rlbus.envs.tasks.python_fn import PythonFnConfig, PythonFnTask, run_hidden_tests
from rlbus.sandbox import Sandbox, SandboxLimits, SandboxResult, find_bwrap

#: Host uids a root worker's sandboxes run as (`Sandbox`'s default ``uid_range``), read from its signature so
#: the survivor checks follow the sandbox if the range ever changes.
SANDBOX_UIDS: range = inspect.signature(Sandbox).parameters["uid_range"].default
#: Extra seconds past the wall-clock limit before a run counts as hung (the worker never got a result).
_HANG_S = 15.0
#: Slack past the wall-clock limit for "the tree was killed at the deadline" (kill, reap, cleanup).
_DEADLINE_SLACK_S = 3.0
#: The whole environment of a plain (unsandboxed) subprocess.
PLAIN_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
_SECRET_ENV = "RLBUS_ESCAPE_SECRET"


# --- escape suite ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Escape:
    """One escape attempt: whether it was contained and the evidence, host-side checks first."""

    name: str
    contained: bool
    status: str
    """The sandbox's status (``ok`` / ``error`` / ``killed`` / ``timeout``), or ``hung`` if none came back."""
    reason: str
    summary: str
    """One short line for the printed table."""
    evidence: list[str]


@dataclass(frozen=True)
class _Host:
    """What the host plants before the suite so that a leak or a side effect is recognisable."""

    token: str
    secret_value: str
    """Value of the ``RLBUS_ESCAPE_SECRET`` environment variable set in the worker."""
    secret_file: Path
    """A world-readable file in the host's /tmp holding ``secret_file_text``."""
    secret_file_text: str
    repo_root: Path
    repo_file: Path
    """The absolute path of ``rlbus/__init__.py``."""
    repo_needle: str
    """Its first line: appears in sandbox output only if the repository was read."""
    shadow_lines: tuple[str, ...]
    """Lines of the host's /etc/shadow (never stored in evidence; compared only)."""
    shadow_exists: bool
    home: Path
    """The worker's home directory on the host (``~``)."""
    worker_cmdline: str
    """The worker's own command line, to recognise it in a process list seen from inside."""

    @property
    def needles(self) -> list[tuple[str, str]]:
        """(what, text) pairs that must never appear in anything the sandbox returns."""
        found = [("the worker's secret env var", self.secret_value)]
        found.append(("the host /tmp secret file", self.secret_file_text))
        found.append(("the repository file", self.repo_needle))
        found += [("a line of the host /etc/shadow", line) for line in self.shadow_lines]
        return found


@dataclass
class _Run:
    """What the reward path gave back for one attack program."""

    result: SandboxResult | None
    """None when the worker got no result within the wall clock + `_HANG_S` (the attack hung the worker)."""
    outputs: list[dict[str, Any]] | str
    elapsed_s: float

    @property
    def report(self) -> dict[str, Any] | None:
        """The dict the attack function returned, if the harness got that far."""
        if isinstance(self.outputs, list) and self.outputs and self.outputs[0].get("ok"):
            value = self.outputs[0].get("value")
            return value if isinstance(value, dict) else None
        return None

    def text(self) -> str:
        """Everything that crossed from the sandbox to the worker: stdout, stderr and the results."""
        if self.result is None:
            return json.dumps(self.outputs)
        return "\n".join([self.result.stdout, self.result.stderr, json.dumps(self.outputs)])


Check = tuple[bool, str]

_PRELUDE = '''\
import json
import os

P = json.loads({params!r})


def _try(fn):
    """"OK: …" when the action worked, "DENIED: …" with what stopped it otherwise."""
    try:
        return "OK: " + repr(fn())[:300]
    except BaseException as exc:
        return "DENIED: " + type(exc).__name__ + ": " + str(exc)[:200]


def _report(result):
    print(json.dumps(result), flush=True)
    return result

'''


def _program(body: str, **params: Any) -> str:
    """An answer module defining ``attack()``; ``params`` reach it as JSON (no quoting games)."""
    return _PRELUDE.format(params=json.dumps(params)) + textwrap.dedent(body)


_READ = """
def attack():
    def look(p):
        def go():
            if os.path.isdir(p):
                return sorted(os.listdir(p))
            with open(p, "rb") as f:
                return f.read(4096).decode(errors="replace")
        return go
    paths = P["paths"] + [os.path.expanduser(p) for p in P.get("user_paths", [])]
    return _report({p: _try(look(p)) for p in paths})
"""


async def _attack(code: str, limits: SandboxLimits) -> _Run:
    """Run ``code`` the way the ``python_fn`` reward runs an answer: its hidden-test harness calls ``attack()``."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(limits.wall_s + _HANG_S):
            result, outputs = await run_hidden_tests(code, "attack", [[]], limits)
    except TimeoutError:
        return _Run(None, f"no result within {limits.wall_s + _HANG_S:g}s: the worker was blocked", _elapsed(start))
    return _Run(result, outputs, _elapsed(start))


def _elapsed(start: float) -> float:
    return round(time.monotonic() - start, 3)


def _denied(run: _Run, keys: Sequence[str] | None = None) -> list[Check]:
    """One check per action the attack tried: it must have been stopped (or the attack must not have reported)."""
    report = run.report
    if report is None:
        return [(False, f"the attack sent no report (outputs: {_short(run.outputs)}), so nothing shows it was stopped")]
    checks = []
    for key in keys if keys is not None else list(report):
        outcome = str(report.get(key, "missing"))
        if outcome.startswith("DENIED"):
            checks.append((True, f"sandbox: {key} → {_short(outcome)}"))
        else:  # what a successful read returned may be a host secret: never copy it into the evidence
            checks.append((False, f"sandbox: {key} → {outcome[:2]} ({len(outcome)} chars of output withheld)"))
    return checks


def _tally(checks: Sequence[Check], what: str) -> str:
    return f"{sum(ok for ok, _ in checks)}/{len(checks)} {what} denied"


def _took(run: _Run) -> str:
    return f"{run.result.status if run.result else 'hung'} after {run.elapsed_s:.1f}s"


def _redact(text: str, host: _Host) -> str:
    """Evidence is written to JSON files: a planted or real secret that leaked must not be copied there too."""
    for what, needle in host.needles:
        if needle:
            text = text.replace(needle, f"[{what}: redacted]")
    return text


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def _judge(name: str, run: _Run, host: _Host, checks: list[Check], summary: str) -> Escape:
    """Add the checks every attempt gets (a result came back, no secret leaked, nothing outlived it).

    ``summary`` describes the contained case; when a check fails, the first failure replaces it.
    """
    common: list[Check] = []
    if run.result is None:
        common.append((False, f"the worker got no result: {run.outputs}"))
    leaked = [what for what, needle in host.needles if needle and needle in run.text()]
    common.append((not leaked, f"host: planted secrets absent from stdout/stderr/results (leaked: {leaked or 'none'})"))
    survivors = await _survivors()
    common.append((not survivors, f"host: no process outlived its sandbox (survivors: {survivors or 'none'})"))
    if isinstance(run.outputs, str):
        common.append((True, f"reward path: {run.outputs}"))
    everything = [(ok, _redact(text, host)) for ok, text in [*checks, *common]]
    failures = [text for ok, text in everything if not ok]
    result = run.result
    return Escape(
        name=name,
        contained=not failures,
        status=result.status if result is not None else "hung",
        reason=_redact(result.reason if result is not None else str(run.outputs), host),
        summary=_short(f"NOT CONTAINED: {failures[0]}", 70) if failures else summary,
        evidence=[text if ok else f"NOT CONTAINED: {text}" for ok, text in everything],
    )


# --- host-side process checks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    uid: int
    state: str
    comm: str
    cmdline: str


def _processes() -> dict[int, _Proc]:
    """Every process on the host (root sees all; others see all of /proc unless hidepid is set)."""
    found: dict[int, _Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            found[int(entry)] = _Proc(
                pid=int(entry),
                ppid=int(fields["PPid"]),
                uid=int(fields["Uid"].split()[0]),
                state=fields["State"].strip()[:1],
                comm=fields["Name"].strip(),
                cmdline=cmdline.strip(),
            )
        except (KeyError, ValueError, IndexError):
            continue
    return found


def _sandboxed(proc: _Proc) -> bool:
    """Whether ``proc`` is something an attack could have started.

    A root worker gives every sandbox a uid of its own from `SANDBOX_UIDS`, so any such uid counts; a
    non-root worker's sandboxes run as the worker itself, so only processes running the reward harness do.
    """
    if os.geteuid() == 0:
        return proc.uid in SANDBOX_UIDS
    return proc.uid == os.getuid() and "harness.py" in proc.cmdline


def _inside_live_sandbox(proc: _Proc, table: dict[int, _Proc]) -> bool:
    """True if ``proc`` or an ancestor is a bwrap process: it belongs to a sandbox that is still running."""
    seen: set[int] = set()
    current: _Proc | None = proc
    while current is not None and current.pid not in seen:
        if current.comm == "bwrap":
            return True
        seen.add(current.pid)
        current = table.get(current.ppid)
    return False


def _escaped_now() -> list[str]:
    table = _processes()
    return [
        f"pid {p.pid} uid {p.uid} {p.cmdline[:80]!r}"
        for p in table.values()
        if p.state not in ("Z", "X") and _sandboxed(p) and not _inside_live_sandbox(p, table)
    ]


async def _survivors(grace_s: float = 2.0) -> list[str]:
    """Sandbox processes with no bwrap above them: they outlived their sandbox (checked after a grace period).

    Other sandboxes may be running concurrently (other workers, other tests); theirs all have a live bwrap
    ancestor, so only a process that escaped its PID namespace's teardown is reported. A process caught
    between ``setuid`` and ``exec bwrap`` would look orphaned for an instant, hence the re-checks.
    """
    deadline = time.monotonic() + grace_s
    while True:
        left = await asyncio.to_thread(_escaped_now)
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.2)


class _ProcessSampler:
    """Samples, in a thread, the most processes one sandbox had at once (evidence for the fork bomb)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.peak = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlbus-escape-sampler", daemon=True)

    def __enter__(self) -> _ProcessSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            counts: dict[int, int] = {}
            for proc in _processes().values():
                if proc.state not in ("Z", "X") and _sandboxed(proc):
                    counts[proc.uid] = counts.get(proc.uid, 0) + 1
            self.peak = max(self.peak, *counts.values(), 0)
            self._stop.wait(self._interval_s)


# --- the attempts ---------------------------------------------------------------------------------------------


async def _fork_bomb(host: _Host, limits: SandboxLimits) -> Escape:
    code = _program("""
        def attack():
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
    """)
    with _ProcessSampler() as sampler:
        run = await _attack(code, limits)
    checks = [_ended_by_deadline(run, limits)]
    if os.geteuid() == 0:  # a uid per sandbox: the sample is this sandbox's process count
        # + 1: the outer bwrap process runs as the sandbox uid too, outside the namespaces' rlimit.
        bound = limits.processes + 1
        checks.append((sampler.peak <= bound, f"host: peak {sampler.peak} processes of the sandbox uid (≤ {bound})"))
    else:
        checks.append((True, f"host: peak {sampler.peak} harness processes (shared uid: evidence only)"))
    summary = f"{_took(run)}, peak {sampler.peak} processes"
    return await _judge("fork_bomb", run, host, checks, summary)


def _ended_by_deadline(run: _Run, limits: SandboxLimits) -> Check:
    """The run ended by a limit (not ``ok``) within the wall clock plus the kill/cleanup slack."""
    if run.result is None:
        return False, "no result"
    bound = limits.wall_s + _DEADLINE_SLACK_S
    ended = run.result.status in ("timeout", "killed", "error") and run.elapsed_s <= bound
    return ended, f"sandbox: {run.result.status} after {run.elapsed_s:.2f}s (≤ {bound:g}s): {run.result.reason}"


async def _memory_hog(host: _Host, limits: SandboxLimits) -> Escape:
    target = 4096
    code = _program("""
        def attack():
            blocks, mib = [], 0
            try:
                while mib < P["target_mib"]:
                    blocks.append(bytearray(64 << 20))
                    mib += 64
            except MemoryError:
                return _report({"allocated_mib": mib, "stopped_by": "MemoryError"})
            return _report({"allocated_mib": mib, "stopped_by": None})
    """, target_mib=target)  # fmt: skip
    run = await _attack(code, limits)
    report = run.report
    checks: list[Check]
    if report is not None:
        got = int(report.get("allocated_mib", target))
        held = got < limits.memory_mb and report.get("stopped_by") == "MemoryError"
        checks = [(held, f"sandbox: allocation stopped by {report.get('stopped_by')} after {got} MiB "
                         f"(address-space limit {limits.memory_mb} MiB, tried {target} MiB)")]  # fmt: skip
    else:
        stopped = run.result is not None and run.result.status in ("killed", "error")
        checks = [(stopped, f"sandbox: the hog was stopped before reporting ({_short(run.outputs)})")]
    summary = f"MemoryError at {report.get('allocated_mib')} MiB" if report is not None else _took(run)
    return await _judge("memory_hog", run, host, checks, f"{summary} (limit {limits.memory_mb} MiB)")


async def _cpu_loop(host: _Host, limits: SandboxLimits) -> Escape:
    code = _program("""
        def attack():
            while True:
                pass
    """)
    run = await _attack(code, limits)
    return await _judge("infinite_loop_cpu", run, host, [_ended_by_deadline(run, limits)], _took(run))


async def _sleep_forever(host: _Host, limits: SandboxLimits) -> Escape:
    code = _program("""
        def attack():
            import time
            time.sleep(10 ** 6)
    """)
    run = await _attack(code, limits)
    return await _judge("sleep_forever_wall_clock", run, host, [_ended_by_deadline(run, limits)], _took(run))


async def _daemon(host: _Host, limits: SandboxLimits) -> Escape:
    """A double-forked, setsid'd daemon ignoring SIGHUP/SIGTERM that would outlive an ``ok`` run."""
    code = _program("""
        def attack():
            import signal, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
                        signal.signal(s, signal.SIG_IGN)
                    os.closerange(0, 3)
                    time.sleep(120)
                os._exit(0)
            os.wait()
            return _report({"daemon": "started"})
    """)
    run = await _attack(code, limits)
    status = run.result.status if run.result is not None else "hung"
    checks: list[Check] = [(True, f"sandbox: the run ended {status}")]
    return await _judge("daemon_outlives_run", run, host, checks, "the daemon died with its sandbox")


async def _network(host: _Host, limits: SandboxLimits) -> Escape:
    """Connect to listeners that really exist on the host's loopback and abstract-socket namespace."""
    arrivals: list[str] = []

    def arrived(kind: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            arrivals.append(kind)
            writer.close()

        return on_connect

    class _Datagrams(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
            arrivals.append("udp")

    abstract = f"\0rlbus-escape-{host.token}"
    tcp = await asyncio.start_server(arrived("tcp"), "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    unix = await asyncio.start_unix_server(arrived("unix"), path=abstract)
    udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(_Datagrams, local_addr=("127.0.0.1", port))
    code = _program("""
        def attack():
            import socket
            port = P["port"]
            def tcp(host, p=None):
                def go():
                    with socket.create_connection((host, p or port), timeout=1):
                        return "connected"
                return go
            def unix():
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(1)
                try:
                    s.connect(P["abstract"])
                    return "connected"
                finally:
                    s.close()
            def udp():
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    return s.sendto(b"escape", ("127.0.0.1", port))
            return _report({
                "tcp 127.0.0.1": _try(tcp("127.0.0.1")),
                "tcp localhost": _try(tcp("localhost")),
                "tcp [::1]": _try(tcp("::1")),
                "tcp 1.1.1.1:53": _try(tcp("1.1.1.1", 53)),
                "unix abstract": _try(unix),
                "udp 127.0.0.1 (judged on the host)": _try(udp),
            })
    """, port=port, abstract=abstract)  # fmt: skip
    try:
        run = await _attack(code, limits)
        await asyncio.sleep(0.2)  # let a connection that did get through be accepted
    finally:
        udp.close()
        for server in (tcp, unix):
            server.close()
            await server.wait_closed()
    keys = ["tcp 127.0.0.1", "tcp localhost", "tcp [::1]", "tcp 1.1.1.1:53", "unix abstract"]
    listeners = f"127.0.0.1:{port} (TCP and UDP) and @rlbus-escape-…"
    checks: list[Check] = [
        (not arrivals, f"host: listeners on {listeners} received {arrivals or 'nothing'}"),
        *_denied(run, keys),
    ]
    if run.report is not None:
        checks.append((True, f"sandbox: udp send → {_short(run.report.get('udp 127.0.0.1 (judged on the host)'))}"))
    summary = f"host listeners got {len(arrivals)}; {_tally(_denied(run, keys), 'connects')}"
    return await _judge("network_host_loopback", run, host, checks, summary)


async def _read(name: str, host: _Host, limits: SandboxLimits, paths: list[str], user_paths: Sequence[str] = (),
                host_facts: Sequence[str] = ()) -> Escape:  # fmt: skip
    run = await _attack(_program(_READ, paths=paths, user_paths=list(user_paths)), limits)
    checks: list[Check] = [(True, f"host: {fact}") for fact in host_facts]
    denied = _denied(run)
    return await _judge(name, run, host, [*denied, *checks], _tally(denied, "reads"))


async def _read_shadow(host: _Host, limits: SandboxLimits) -> Escape:
    fact = f"/etc/shadow exists: {host.shadow_exists}, readable by the worker: {bool(host.shadow_lines)}"
    return await _read("read_etc_shadow", host, limits, ["/etc/shadow", "/etc/passwd", "/etc"], host_facts=[fact])


async def _read_home(host: _Host, limits: SandboxLimits) -> Escape:
    paths = sorted({"/root", "/root/.ssh", "/home", str(host.home), str(host.home / ".ssh")})
    facts = [f"exists on the host: {await asyncio.to_thread(_existing, paths)}"]
    return await _read("read_home_and_ssh", host, limits, paths, user_paths=["~/.ssh"], host_facts=facts)


async def _read_repo(host: _Host, limits: SandboxLimits) -> Escape:
    paths = [str(host.repo_file), str(host.repo_root), str(host.secret_file)]
    facts = [f"{host.repo_file} and the world-readable {host.secret_file} exist on the host"]
    return await _read("read_repository_files", host, limits, paths, host_facts=facts)


async def _symlink_results(host: _Host, limits: SandboxLimits) -> Escape:
    """Make the results file a symlink to a host secret and exit: the worker must not follow it."""
    code = _program("""
        def attack():
            os.symlink(P["target"], "results.json")
            os._exit(0)
    """, target=str(host.secret_file))  # fmt: skip
    run = await _attack(code, limits)
    refused = isinstance(run.outputs, str)
    checks: list[Check] = [(refused, "worker: did not follow the symlink")]
    return await _judge("symlink_results_to_host_file", run, host, checks, "the worker refused the symlink")


async def _fifo_results(host: _Host, limits: SandboxLimits) -> Escape:
    """Make the results file a FIFO and exit: a worker that opened it blocking would hang forever."""
    code = _program("""
        def attack():
            os.mkfifo("results.json")
            os._exit(0)
    """)
    run = await _attack(code, limits)
    ok = run.result is not None and run.elapsed_s <= limits.wall_s + _DEADLINE_SLACK_S
    check = (ok, f"worker: got a result in {run.elapsed_s:.2f}s without blocking on the FIFO")
    return await _judge("fifo_results_blocks_worker", run, host, [check], f"result in {run.elapsed_s:.2f}s, no hang")


async def _write_outside(host: _Host, limits: SandboxLimits) -> Escape:
    name = f"rlbus-escape-{host.token}"
    targets = [Path("/tmp") / name, host.repo_root / name, host.repo_root.parent / name, Path("/") / name,
               Path("/usr") / name, Path("/dev/shm") / name, Path("/var/tmp") / name,
               host.home / name]  # fmt: skip
    before = _fingerprint(host.repo_file)
    code = _program("""
        def attack():
            out = {}
            for p in P["paths"]:
                def create(p=p):
                    with open(p, "x") as f:
                        return f.write(P["token"])
                out[p] = _try(create)
            out[P["repo_file"] + " (open for append)"] = _try(lambda: open(P["repo_file"], "a").close())
            return _report(out)
    """, paths=[str(t) for t in targets], token=host.token, repo_file=str(host.repo_file))  # fmt: skip
    run = await _attack(code, limits)
    created = await asyncio.to_thread(_remove_existing, targets)
    checks: list[Check] = [
        (not created, f"host: none of {len(targets)} target files exists afterwards (found: {created or 'none'})"),
        (_fingerprint(host.repo_file) == before, f"host: {host.repo_file} unchanged (sha256 + mtime)"),
    ]
    if run.report is not None:
        checks += [(True, f"sandbox: {k} → {_short(v, 100)}") for k, v in run.report.items()]
        tmp_inside = run.report.get(str(targets[0]), "")
        if str(tmp_inside).startswith("OK"):
            checks.append((True, "the /tmp write landed in the world directory (the sandbox's /tmp → /sandbox)"))
    summary = f"{len(created)}/{len(targets)} files on the host, repo unchanged"
    return await _judge("write_outside_sandbox", run, host, checks, summary)


def _existing(paths: Sequence[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


def _remove_existing(paths: Sequence[Path]) -> list[str]:
    """The paths that exist (an escape wrote them), removed so an escape leaves no litter behind."""
    found = [str(p) for p in paths if os.path.lexists(p)]
    for path in found:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return found


def _fingerprint(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


async def _kill(name: str, host: _Host, limits: SandboxLimits, body: str) -> Escape:
    """Run a kill attempt while a sibling sandbox and a host canary process are alive; all must survive."""
    victim_code = _program("""
        def attack():
            import time
            time.sleep(P["sleep_s"])
            return "alive"
    """, sleep_s=2.0)  # fmt: skip
    victim_limits = SandboxLimits(wall_s=max(limits.wall_s, 8.0), cpu_s=limits.cpu_s, memory_mb=limits.memory_mb)
    canary = await asyncio.create_subprocess_exec("/bin/sleep", "60", env=PLAIN_ENV, start_new_session=True)
    victim = asyncio.create_task(run_hidden_tests(victim_code, "attack", [[]], victim_limits))
    try:
        await asyncio.sleep(0.5)  # the sibling's sandbox is up and sleeping
        run = await _attack(_program(body), limits)
        _, victim_outputs = await victim
        canary_alive = canary.returncode is None and _alive(canary.pid)
    finally:
        if not victim.done():
            victim.cancel()  # cancelling a sandboxed run kills its process tree
            await asyncio.gather(victim, return_exceptions=True)
        if canary.returncode is None:
            canary.kill()
        await canary.wait()
    sibling_ok = isinstance(victim_outputs, list) and victim_outputs[0].get("value") == "alive"
    checks: list[Check] = [
        (_alive(os.getpid()), f"host: the worker (pid {os.getpid()}) is alive and received the sandbox's result"),
        (canary_alive, f"host: canary process (pid {canary.pid}, uid {os.getuid()}) still alive"),
        (sibling_ok, f"host: a sibling sandbox running at the same time finished normally ({_short(victim_outputs)})"),
    ]
    if run.report is not None:
        checks.append((True, f"sandbox: {_short(run.report)}"))
    return await _judge(name, run, host, checks, "worker, canary and sibling sandbox alive")


def _alive(pid: int) -> bool:
    """Running, not merely present: a killed child stays a zombie until asyncio's watcher reaps it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


async def _kill_parent(host: _Host, limits: SandboxLimits) -> Escape:
    return await _kill("kill_parent", host, limits, """
        def attack():
            import signal, time
            ppid = os.getppid()
            result = {"ppid seen inside": ppid, "kill(ppid, SIGKILL)": _try(lambda: os.kill(ppid, signal.SIGKILL))}
            time.sleep(0.3)
            return _report(result)
    """)  # fmt: skip


async def _kill_all(host: _Host, limits: SandboxLimits) -> Escape:
    return await _kill("kill_all", host, limits, """
        def attack():
            import signal, time
            result = {"kill(-1, SIGKILL)": _try(lambda: os.kill(-1, signal.SIGKILL))}
            time.sleep(0.3)
            return _report(result)
    """)  # fmt: skip


async def _env_leak(host: _Host, limits: SandboxLimits) -> Escape:
    code = _program("""
        def attack():
            def read(p):
                return lambda: open(p, "rb").read().decode(errors="replace").split("\\0")
            return _report({
                "os.environ": dict(os.environ),
                "/proc/self/environ": _try(read("/proc/self/environ")),
                "/proc/1/environ": _try(read("/proc/1/environ")),
            })
    """)
    run = await _attack(code, limits)
    named = _SECRET_ENV in run.text()
    keys = sorted(run.report.get("os.environ", {})) if run.report is not None else "no report"
    checks: list[Check] = [
        (run.report is not None, f"sandbox: environment it saw has keys {keys}"),
        (not named, f"host: {_SECRET_ENV} (set in the worker) appears neither by name nor by value"),
    ]
    summary = f"secret absent; {len(keys)} variables inside" if run.report is not None else "no report"
    return await _judge("environment_variables", run, host, checks, summary)


async def _proc(host: _Host, limits: SandboxLimits) -> Escape:
    pid, repo = os.getpid(), str(host.repo_file)
    reads = [
        "/proc/1/root/etc/shadow",
        f"/proc/self/root{repo}",
        f"/proc/1/root/../../..{repo}",
        f"/proc/self/cwd/../../..{repo}",
        f"/proc/{pid}/environ",
        f"/proc/{pid}/root{repo}",
    ]
    code = _program("""
        def attack():
            def cmdline(pid):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        return f.read().replace(b"\\0", b" ").decode(errors="replace").strip()
                except OSError as exc:
                    return type(exc).__name__
            def read(p):
                def go():
                    with open(p, "rb") as f:
                        return f.read(4096).decode(errors="replace")
                return go
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            result = {"visible processes": {str(p): cmdline(p) for p in pids}}
            result.update({p: _try(read(p)) for p in P["reads"]})
            return _report(result)
    """, reads=reads)  # fmt: skip
    run = await _attack(code, limits)
    checks: list[Check] = []
    if run.report is not None:
        visible: dict[str, str] = run.report.get("visible processes", {})
        isolated = len(visible) <= limits.processes and host.worker_cmdline not in visible.values()
        checks.append((isolated, f"sandbox: sees {len(visible)} processes, none of the host's: {_short(visible, 200)}"))
    denied = _denied(run, reads)
    visible_count = len(run.report.get("visible processes", {})) if run.report is not None else "?"
    summary = f"{visible_count} pids visible; {_tally(denied, 'reads')}"
    return await _judge("proc_escape", run, host, [*checks, *denied], summary)


async def _privilege(host: _Host, limits: SandboxLimits) -> Escape:
    """Regain privileges: a nested user namespace (root inside), a mount namespace, setuid, chroot, mount."""
    code = _program("""
        def attack():
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            def call(name, *args):
                def go():
                    if getattr(libc, name)(*args) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, os.strerror(err))
                    return "succeeded"
                return go
            return _report({
                "unshare(CLONE_NEWUSER)": _try(call("unshare", 0x10000000)),
                "unshare(CLONE_NEWNS)": _try(call("unshare", 0x00020000)),
                "setuid(0)": _try(lambda: os.setuid(0)),
                "chroot(/sandbox)": _try(lambda: os.chroot("/sandbox")),
                "mount(tmpfs, /sandbox)": _try(call("mount", b"none", b"/sandbox", b"tmpfs", 0, None)),
            })
    """)
    run = await _attack(code, limits)
    denied = _denied(run)
    return await _judge("privilege_regain", run, host, denied, _tally(denied, "calls"))


_ATTEMPTS: tuple[Callable[[_Host, SandboxLimits], Awaitable[Escape]], ...] = (
    _fork_bomb,
    _memory_hog,
    _cpu_loop,
    _sleep_forever,
    _daemon,
    _network,
    _read_shadow,
    _read_home,
    _read_repo,
    _symlink_results,
    _fifo_results,
    _write_outside,
    _kill_parent,
    _kill_all,
    _env_leak,
    _proc,
    _privilege,
)


async def escape_suite(*, timeout_s: float = 3.0) -> list[Escape]:
    """Run every escape attempt through the ``python_fn`` reward path; one `Escape` per attempt.

    The limits are the task's own (`PythonFnTask.sandbox_limits`) with a short wall clock so the
    deadline-bound attempts stay quick. Raises SandboxError when the sandbox cannot be built (bwrap missing,
    no user namespaces): a suite that ran nothing must never read as "all contained".
    """
    find_bwrap()
    limits = PythonFnTask(PythonFnConfig(timeout_s=timeout_s)).sandbox_limits()
    host = _plant()
    previous = os.environ.get(_SECRET_ENV)
    os.environ[_SECRET_ENV] = host.secret_value
    try:
        return [await attempt(host, limits) for attempt in _ATTEMPTS]
    finally:
        if previous is None:
            os.environ.pop(_SECRET_ENV, None)
        else:
            os.environ[_SECRET_ENV] = previous
        with contextlib.suppress(OSError):
            host.secret_file.unlink()


def _plant() -> _Host:
    token = uuid.uuid4().hex
    secret_text = f"rlbus-host-secret-{uuid.uuid4().hex}"
    fd, name = tempfile.mkstemp(prefix="rlbus-escape-secret-", dir="/tmp")
    with os.fdopen(fd, "w") as f:
        f.write(secret_text)
    os.chmod(name, 0o644)  # world-readable: only the sandbox's view of the filesystem keeps it out
    repo_file = Path(rlbus.__file__).resolve()
    try:
        shadow = tuple(line for line in Path("/etc/shadow").read_text().splitlines() if len(line) >= 8)
    except OSError:
        shadow = ()
    cmdline = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    first_line = next((line for line in repo_file.read_text().splitlines() if line.strip()), "")
    return _Host(
        token=token,
        secret_value=f"rlbus-env-secret-{uuid.uuid4().hex}",
        secret_file=Path(name),
        secret_file_text=secret_text,
        repo_root=repo_file.parent.parent,
        repo_file=repo_file,
        repo_needle=first_line if len(first_line) >= 12 else repo_file.read_text(),
        shadow_lines=shadow,
        shadow_exists=os.path.exists("/etc/shadow"),
        home=Path(os.path.expanduser("~")),
        worker_cmdline=cmdline,
    )
