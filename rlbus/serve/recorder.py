"""Served-traffic recording that never slows or fails serving: a bounded buffer in front of the bus.

(The same class buffers the rollouts of completions recorded as rollouts, on ``rl.rollouts.v1``.)

The gateway hands every served completion to :meth:`ServedRecorder.record`, which only appends to an
in-memory buffer and returns — the response never waits for Kafka. One background task (:meth:`run`)
drains the buffer onto ``rl.served.v1`` in batches (up to ``batch`` sends in flight, which the Kafka
producer packs into few requests). When the bus is down — unreachable at start, or failing later — the
task keeps the records, retries every ``retry_s`` and flushes them, in order, once sends succeed again.

The buffer is bounded (``capacity`` records): while the bus stays down past that, the *oldest* records
are dropped — for learning from live traffic the newest are worth most — and every drop is counted
(``dropped``, metric ``rlbus_served_dropped``); ``buffered`` and ``recorded`` are metrics too. Delivery is
at least once: a send that timed out may still land and is then sent again, so consumers deduplicate on
(``served_id``, ``choice_index``). On stop the task flushes for at most ``drain_s``; what is left is
reported as ``unflushed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from rlbus.bus.base import Bus
from rlbus.bus.topic import Topic
from rlbus.bus.topics import SERVED
from rlbus.errors import BusError
from rlbus.metrics import SERVED_BUFFERED, SERVED_DROPPED, SERVED_RECORDED

log = logging.getLogger("rlbus.serve.recorder")


class ServedRecorder:
    def __init__(
        self,
        *,
        bus: Bus,
        topic: Topic[Any] = SERVED,
        capacity: int = 10_000,
        batch: int = 64,
        send_timeout_s: float = 10.0,
        retry_s: float = 1.0,
        drain_s: float = 5.0,
        connect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``connect``: called (and retried) before the first send — e.g. ``bus.start`` for a bus that may
        be unreachable when the gateway starts; None when the bus is already started."""
        if capacity < 1 or batch < 1:
            raise ValueError("capacity and batch must be >= 1")
        self._bus = bus
        self._topic = topic
        self.capacity = capacity
        self._batch = batch
        self._send_timeout_s = send_timeout_s
        self.retry_s = retry_s
        self._drain_s = drain_s
        self._connect = connect
        self._connected = connect is None
        self._buffer: deque[Any] = deque()
        self._sending = 0
        #: Set while no send is in flight (`flush` waits on it for the drain task's sends).
        self._settled = asyncio.Event()
        self._settled.set()
        self._wake = asyncio.Event()
        self.recorded = 0
        self.dropped = 0
        self.unflushed = 0
        self.failures = 0
        self.last_error: str | None = None
        #: True while sends fail (from the first failure to the next success).
        self.down = False

    @property
    def buffered(self) -> int:
        """Records not yet acknowledged: waiting, or being sent right now."""
        return len(self._buffer) + self._sending

    def stats(self) -> dict[str, Any]:
        return {"recorded": self.recorded, "buffered": self.buffered, "dropped": self.dropped,
                "down": self.down, "failures": self.failures, "last_error": self.last_error}

    def record(self, served: Any) -> None:
        """Queue one record; never blocks, never raises. A full buffer drops its oldest record."""
        if len(self._buffer) >= self.capacity:
            self._buffer.popleft()
            self.dropped += 1
            SERVED_DROPPED.inc()
        self._buffer.append(served)
        self._gauge()
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Drain the buffer onto the bus until ``stop``; then flush for at most ``drain_s``."""
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                if not self._buffer:
                    self._wake.clear()
                    waker = asyncio.create_task(self._wake.wait())
                    await asyncio.wait([waker, stopping], return_when=asyncio.FIRST_COMPLETED)
                    waker.cancel()
                    continue
                if not await self._flush_once():
                    await asyncio.wait([stopping], timeout=self.retry_s)
        finally:
            stopping.cancel()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._drain_s):
                    while self._buffer and await self._flush_once():
                        pass
            self.unflushed = len(self._buffer)
            if self.unflushed:
                log.warning("stopping with %d served records not written to %s (bus down: %s)",
                            self.unflushed, self._topic.name, self.last_error)

    async def flush(self) -> bool:
        """Try to write everything buffered now; True once every record is acknowledged — those the drain
        task (`run`) is sending at the time included (tests, benchmarks)."""
        while self._buffer or self._sending:
            if self._buffer:
                if not await self._flush_once():
                    return False
            else:  # the drain task's sends are in flight: wait for them (a failed one comes back to the buffer)
                self._settled.clear()
                await self._settled.wait()
        return True

    async def _flush_once(self) -> bool:
        """Send up to ``batch`` of the oldest records; False (records kept) if the bus failed."""
        if not self._connected:
            assert self._connect is not None
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await self._connect()
                self._connected = True
            except (BusError, OSError, TimeoutError) as exc:
                return self._failed(f"connect: {exc or type(exc).__name__}")
        taken = [self._buffer.popleft() for _ in range(min(self._batch, len(self._buffer)))]
        self._sending += len(taken)  # `flush` and the drain task may both be sending
        try:
            results = await asyncio.gather(*(self._send(s) for s in taken), return_exceptions=True)
        except asyncio.CancelledError:
            self._buffer.extendleft(reversed(taken))
            raise
        finally:
            self._sending -= len(taken)
            if not self._sending:
                self._settled.set()
        failed = [s for s, r in zip(taken, results, strict=True) if isinstance(r, BaseException)]
        sent = len(taken) - len(failed)
        self.recorded += sent
        if self._topic is SERVED:
            SERVED_RECORDED.inc(sent)
        room = self.capacity - len(self._buffer)
        keep = failed[-room:] if room > 0 else []  # records queued meanwhile may have filled the buffer
        self._lost(len(failed) - len(keep))
        self._buffer.extendleft(reversed(keep))
        self._gauge()
        if failed:
            errors = [r for r in results if isinstance(r, BaseException)]
            return self._failed(f"{type(errors[0]).__name__}: {errors[0]}")
        if self.down:
            log.info("bus back: %s writes resumed, %d records still buffered", self._topic.name, len(self._buffer))
        self.down = False
        return True

    async def _send(self, served: Any) -> None:
        async with asyncio.timeout(self._send_timeout_s):
            await self._bus.send(self._topic, served)

    def _failed(self, error: str) -> bool:
        if not self.down:
            log.warning("cannot write to %s (%s); buffering served records (%d now, capacity %d)",
                        self._topic.name, error, len(self._buffer), self.capacity)
        self.down = True
        self.failures += 1
        self.last_error = error
        return False

    def _gauge(self) -> None:
        if self._topic is SERVED:
            SERVED_BUFFERED.set(self.buffered)

    def _lost(self, n: int) -> None:
        if n > 0:
            self.dropped += n
            SERVED_DROPPED.inc(n)
