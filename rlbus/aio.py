"""Waiting with a timeout, safely on Python 3.11; and polling a condition until it holds.

On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that lands as its inner awaitable
finishes or its timeout fires (CPython gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on
``asyncio.timeout``). A worker loop that waits for its stop event with ``wait_for`` can then miss the
cancel its task group sends when a sibling fails, and run on forever: rlbus hit this as a 1-in-12 hang of
a crash test. Every timed wait in rlbus goes through ``asyncio.timeout``, here or inline.

:func:`until` is the one poll loop of the package and its tests (the chaos rig, the test suite): it
returns as soon as the condition holds, so a generous budget — what a loaded two-core CI machine needs —
costs nothing when things go well, and its error names what it waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it is set. Cancellation propagates."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()


async def wait_any(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set (e.g. a worker's first weight version, or its stop)."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def until(
    condition: Callable[[], Any],
    what: str,
    *,
    timeout_s: float = 30.0,
    every_s: float = 0.02,
    check: Callable[[], None] | None = None,
) -> None:
    """Poll ``condition`` (plain or async) until its result is truthy. ``check`` runs between polls and
    may raise to give up early (a process the wait depends on died). Raises :class:`TimeoutError` naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(every_s)
