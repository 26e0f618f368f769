"""GracefulStop in a real process: one signal drains and exits 0, a second exits at once with 128+N,
even while the event loop is blocked."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import asyncio, signal, sys, threading, time
from rlbus.launch.signals import GracefulStop

async def main():
    with GracefulStop(on_first=lambda n: print("first", n, flush=True)) as stopping:
        print("ready", flush=True)
        await stopping.stop.wait()
        print("draining", flush=True)
        if sys.argv[1] == "block":
            time.sleep(30)  # a synchronous call holding the loop
        elif sys.argv[1] == "other-thread":
            # The second signal lands on another thread while the main thread sleeps in C: a Python-level
            # handler would wait the full 30 s for the main thread; the wakeup-fd watcher must not.
            def kill_me():
                time.sleep(0.3)
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            threading.Thread(target=kill_me).start()
            time.sleep(30)
        else:
            await asyncio.sleep(float(sys.argv[1]))
        print("drained", flush=True)

asyncio.run(main())
"""


def start(arg: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, arg], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def wait_for(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdout is not None
    got = process.stdout.readline().strip()
    while got.startswith("first"):
        got = process.stdout.readline().strip()
    assert got == line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_one_signal_drains_and_exits_zero(sig: signal.Signals) -> None:
    process = start("0.5")
    process.send_signal(sig)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert out.split() == ["first", str(int(sig)), "draining", "drained"]


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_second_signal_exits_at_once(sig: signal.Signals, status: int) -> None:
    process = start("30")
    process.send_signal(sig)
    wait_for(process, "draining")
    started = time.monotonic()
    process.send_signal(sig)
    out, _ = process.communicate(timeout=10)
    assert process.returncode == status
    assert "drained" not in out
    assert time.monotonic() - started < 5


def test_the_second_signal_works_while_the_loop_is_blocked() -> None:
    process = start("block")
    process.send_signal(signal.SIGTERM)
    wait_for(process, "draining")
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=10)
    assert process.returncode == 143
    assert time.monotonic() - started < 5


def test_a_signal_caught_by_another_thread_still_exits_at_once() -> None:
    process = start("other-thread")
    process.send_signal(signal.SIGTERM)
    wait_for(process, "draining")
    started = time.monotonic()
    process.communicate(timeout=10)
    assert process.returncode == 143
    assert time.monotonic() - started < 5
