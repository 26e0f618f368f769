"""Timed waits and polling: the helpers' contracts, and no ``asyncio.wait_for`` left in the package (gh-86296)."""

import asyncio
import re
from pathlib import Path

import pytest

import rlbus
from rlbus.aio import until, wait_event


async def test_wait_event_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True


async def test_a_cancel_reaches_the_waiter_even_as_the_event_is_set() -> None:
    """The gh-86296 shape: the event is set and the waiter cancelled in the same loop turn."""
    for _ in range(50):
        event = asyncio.Event()
        waiter = asyncio.create_task(wait_event(event, 5.0))
        await asyncio.sleep(0)
        event.set()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter


def test_the_package_has_no_asyncio_wait_for() -> None:
    package = Path(rlbus.__file__).parent
    users = [str(path.relative_to(package)) for path in package.rglob("*.py")
             if re.search(r"asyncio\.wait_for\(", path.read_text())]
    assert users == [], f"use asyncio.timeout or rlbus.aio.wait_event instead of asyncio.wait_for in {users}"


async def test_until_polls_plain_and_async_conditions() -> None:
    ticks: list[int] = []

    def plain() -> bool:
        ticks.append(1)
        return len(ticks) >= 3

    async def later() -> list[int]:  # any truthy result ends the wait
        return ticks if len(ticks) >= 5 else []

    await until(plain, "three polls", every_s=0.001)
    ticks.extend([1, 1])
    await until(later, "five ticks", every_s=0.001)


async def test_until_names_what_it_waited_for_and_lets_a_check_give_up() -> None:
    with pytest.raises(TimeoutError, match="waiting for the impossible"):
        await until(lambda: False, "the impossible", timeout_s=0.05, every_s=0.01)

    def dead() -> None:
        raise RuntimeError("the worker exited")

    with pytest.raises(RuntimeError, match="the worker exited"):
        await until(lambda: False, "anything", timeout_s=30, check=dead)


async def test_wait_any_returns_on_the_first_event_set() -> None:
    from rlbus.aio import wait_any

    first, second = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, second.set)
    async with asyncio.timeout(5):
        await wait_any(first, second)
    assert second.is_set() and not first.is_set()
