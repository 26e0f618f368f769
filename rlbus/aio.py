"""Waiting with a timeout, safely on Python 3.11.

On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that lands as its inner awaitable
finishes or its timeout fires (CPython gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on
``asyncio.timeout``). A worker loop that waits for its stop event with ``wait_for`` can then miss the
cancel its task group sends when a sibling fails, and run on forever: rlbus hit this as a 1-in-12 hang of
a crash test. Every timed wait in rlbus goes through ``asyncio.timeout``, here or inline.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it is set. Cancellation propagates."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()
