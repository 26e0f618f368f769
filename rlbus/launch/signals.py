"""Graceful stop for every rlbus process: the first SIGTERM/SIGINT drains, the second exits at once.

A worker stopped by its orchestrator (``docker stop``, Kubernetes, ``rlbus up``, Ctrl-C) should finish
what it holds — the episodes in flight, the batch being scored, the training step — commit its offsets
and leave its consumer group, so nothing is redelivered and the group rebalances once. That is the
first signal: it sets the ``stop`` event every worker's ``run(stop)`` watches, and the process exits 0
when the workers return. An operator who does not want to wait sends a second signal: the process then
exits immediately with the shell's convention ``128 + signal`` (130 for SIGINT, 143 for SIGTERM),
without draining; Kafka redelivers whatever was not committed.

Signals are counted on a watcher thread fed by :func:`signal.set_wakeup_fd`, not in a Python-level
handler. A Python handler runs only when the main thread next executes bytecode, and a signal that
lands between the interpreter's last check and a blocking call (the event loop's ``epoll_wait`` with a
30 s timeout, or a long ``time.sleep``) waits for that call to return: the second signal would then not
"exit at once" (CI saw exactly this, once in hundreds of runs). The C-level handler writes the signal
number to the wakeup socket from whatever thread the kernel interrupted, so the watcher sees every
signal immediately, even while the loop is blocked. The first signal reaches the loop with
``call_soon_threadsafe``; the second calls ``exit`` from the watcher. If a wakeup fd was already set
(asyncio's ``add_signal_handler`` uses one), every byte is forwarded to it, so those handlers still run.

Usage::

    async def main() -> None:
        with GracefulStop() as stopping:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(worker.run(stopping.stop))
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger("rlbus.launch.signals")

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """What a shell reports for a process ended by ``signum``: 128 + the signal number."""
    return 128 + signum


def _exit_now(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _noop(signum: int, frame: FrameType | None) -> None:
    """Installed for the stop signals so their default action does not kill the process."""


class GracefulStop:
    """Installs the handlers on enter (on the running loop's thread) and restores the old ones on exit.

    ``stop`` is set by the first signal; ``signals`` records what arrived. ``on_first`` runs (in the
    loop) after the event is set, e.g. to forward SIGTERM to child processes; ``exit`` is what the
    second signal calls with the status, on the watcher thread (so it must not need the event loop).
    """

    def __init__(
        self,
        *,
        signals: Sequence[signal.Signals] = STOP_SIGNALS,
        on_first: Callable[[int], None] | None = None,
        exit: Callable[[int], None] = _exit_now,
    ) -> None:
        self.stop = asyncio.Event()
        self.signals: list[int] = []
        self._which = tuple(signals)
        self._on_first = on_first
        self._exit = exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}
        self._previous_wakeup = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> GracefulStop:
        self._loop = asyncio.get_running_loop()
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd requires it; a full buffer drops bytes, never blocks
        self._sockets = (reader, writer)
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in self._which:
            # The Python-level handler only keeps the default action (termination) away; the watcher acts.
            self._previous[sig] = signal.signal(sig, _noop)
        self._watcher = threading.Thread(target=self._watch, args=(reader,), name="rlbus-signals", daemon=True)
        self._watcher.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        reader, writer = self._sockets
        self._sockets = None
        writer.close()  # the watcher's recv returns b"" and the thread ends
        if self._watcher is not None:
            self._watcher.join(timeout=1.0)
        reader.close()

    def _watch(self, reader: socket.socket) -> None:
        """The watcher thread: one byte per signal, written by the C-level handler."""
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if self._previous_wakeup != -1:
                    try:
                        os.write(self._previous_wakeup, bytes([signum]))
                    except OSError:
                        pass  # a full or closed pipe: the owner loses a wakeup, as it would without us
                if signum in self._which:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        self.signals.append(signum)
        if len(self.signals) > 1:
            self._exit(exit_status(signum))
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._first, signum)
        except RuntimeError:  # the loop already closed: nothing left to drain
            self._exit(exit_status(signum))

    def _first(self, signum: int) -> None:
        log.warning("%s: stopping after in-flight work (send it again to exit at once)", signal.Signals(signum).name)
        self.stop.set()
        if self._on_first is not None:
            self._on_first(signum)

    def trigger(self) -> None:
        """Stop as the first signal would, from code (e.g. ``--steps`` reached)."""
        self.stop.set()
