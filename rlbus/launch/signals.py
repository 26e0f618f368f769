"""Graceful stop for every rlbus process: the first SIGTERM/SIGINT drains, the second exits at once.

A worker stopped by its orchestrator (``docker stop``, Kubernetes, ``rlbus up``, Ctrl-C) should finish
what it holds — the episodes in flight, the batch being scored, the training step — commit its offsets
and leave its consumer group, so nothing is redelivered and the group rebalances once. That is the
first signal: it sets the ``stop`` event every worker's ``run(stop)`` watches, and the process exits 0
when the workers return. An operator who does not want to wait sends a second signal: the process then
exits immediately with the shell's convention ``128 + signal`` (130 for SIGINT, 143 for SIGTERM),
without draining; Kafka redelivers whatever was not committed.

The handlers are plain ``signal.signal`` handlers rather than ``loop.add_signal_handler``: they run in
the main thread as soon as the interpreter gets control, so the second signal still works while the
event loop is busy (a long synchronous call on the loop would delay an asyncio handler indefinitely).
The first signal reaches the loop with ``call_soon_threadsafe``.

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
import sys
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


class GracefulStop:
    """Installs the handlers on enter (on the running loop's thread) and restores the old ones on exit.

    ``stop`` is set by the first signal; ``signals`` records what arrived. ``on_first`` runs (in the
    loop) after the event is set, e.g. to forward SIGTERM to child processes; ``exit`` is what the
    second signal calls with the status (tests substitute it).
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

    def __enter__(self) -> GracefulStop:
        self._loop = asyncio.get_running_loop()
        for sig in self._which:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)
        if len(self.signals) > 1:
            self._exit(exit_status(signum))
            return
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._first, signum)

    def _first(self, signum: int) -> None:
        log.warning("%s: stopping after in-flight work (send it again to exit at once)", signal.Signals(signum).name)
        self.stop.set()
        if self._on_first is not None:
            self._on_first(signum)

    def trigger(self) -> None:
        """Stop as the first signal would, from code (e.g. ``--steps`` reached)."""
        self.stop.set()
