"""The processes of ``rlbus up``: started in their own sessions, their output relayed line by line under their
name in its own colour, stopped together (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.text import Text

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")


@dataclass
class Child:
    """One supervised process: its name (the log prefix), command line and environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: asyncio.subprocess.Process | None = None
    returncode: int | None = None


class Supervisor:
    """Starts children in their own sessions, relays their output prefixed, stops them in one go."""

    def __init__(self, *, console: Console | None = None, grace_s: float = 30.0) -> None:
        self.console = console or Console(highlight=False)
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.exited = asyncio.Event()
        self._pumps: list[asyncio.Task[None]] = []
        self._width = 8

    async def start(self, child: Child) -> Child:
        env = {**os.environ, **child.env, "PYTHONUNBUFFERED": "1"}
        child.process = await asyncio.create_subprocess_exec(
            *child.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        self.children.append(child)
        self._width = max(self._width, len(child.name))
        colour = COLOURS[(len(self.children) - 1) % len(COLOURS)]
        self._pumps.append(asyncio.create_task(self._pump(child, colour)))
        return child

    async def _pump(self, child: Child, colour: str) -> None:
        assert child.process is not None and child.process.stdout is not None
        async for raw in child.process.stdout:
            self.say(child.name, raw.decode(errors="replace").rstrip(), colour)
        child.returncode = await child.process.wait()
        self.say(child.name, f"exited with status {child.returncode}", colour)
        self.exited.set()

    def say(self, name: str, line: str, colour: str = "white") -> None:
        self.console.print(Text.assemble((f"{name:>{self._width}} │ ", colour), line), soft_wrap=True)

    def running(self) -> list[Child]:
        return [c for c in self.children if c.process is not None and c.process.returncode is None]

    def signal_all(self, sig: signal.Signals, children: Sequence[Child] | None = None) -> None:
        for child in self.running() if children is None else children:
            assert child.process is not None
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(sig)

    async def stop(self, children: Sequence[Child] | None = None) -> None:
        """SIGTERM ``children`` (default: all), SIGKILL those still running after ``grace_s``, and wait
        until they have exited."""
        chosen = [c for c in (self.children if children is None else children) if c in self.running()]
        self.signal_all(signal.SIGTERM, chosen)
        waits = [asyncio.create_task(c.process.wait()) for c in chosen if c.process is not None]
        if waits:
            await asyncio.wait(waits, timeout=self.grace_s)
        left = [c for c in chosen if c in self.running()]
        if left:
            self.say("up", f"killing {', '.join(c.name for c in left)} after {self.grace_s:.0f} s")
            self.signal_all(signal.SIGKILL, left)
        await asyncio.gather(*waits, return_exceptions=True)
        if children is None:
            await asyncio.gather(*self._pumps, return_exceptions=True)

    def kill_now(self, status: int) -> None:
        """The second Ctrl-C: kill every child, then leave (used from a signal handler)."""
        for child in self.running():
            assert child.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid, signal.SIGKILL)
        os._exit(status)
