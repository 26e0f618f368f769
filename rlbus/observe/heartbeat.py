"""Workers announce themselves: a periodic entry in the state store's worker registry.

Every process runs one :class:`Heartbeat` beside its worker. Each beat writes who the worker is (role,
id, region, host, pid, start time, rlbus version), how fast it works (``throughput``: the growth of the
``processed`` count its ``info()`` reports, per second over the last ``window_s`` seconds of beats, so
a worker between two prompts does not read as idle) and whatever its
``info()`` returns — the workers' ``stats()`` methods: counts, policy version, consumer lag, recent swap
pauses, the trainer's latest step. The entry expires ``ttl_s`` after the last beat, so a crashed worker
drops out of ``rlbus status`` on its own; a stopping one sends a last beat marked ``stopping`` that
expires after one interval. A state store that is briefly unreachable costs a beat, never the worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from importlib import metadata
from typing import Any

from rlbus.aio import wait_event
from rlbus.errors import RlbusError
from rlbus.state.base import StateStore

log = logging.getLogger("rlbus.observe.heartbeat")

Info = Callable[[], dict[str, Any]]


def rlbus_version() -> str:
    try:
        return metadata.version("rlbus")
    except metadata.PackageNotFoundError:
        return "unknown"


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as None and tuples as lists: the registry is JSON read by
    other languages too (the dashboard), and JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


class Heartbeat:
    """Beats every ``every_s`` seconds into ``state`` until ``stop`` is set (see the module docstring).

    A rollout process, for example, runs it beside everything else it reports on::

        loop_lag = LoopLagMonitor()
        beat = Heartbeat(state=state, role="rollout", worker_id=wid, region=region,
                         info=lambda: {**worker.stats(), **sync.stats(), **loop_lag.stats()})
        async with serve_metrics(9400, "127.0.0.1"), asyncio.TaskGroup() as tasks:
            for part in (worker, sync, beat, loop_lag):
                tasks.create_task(part.run(stop))

    (A container binds ``0.0.0.0`` instead — ``run.metrics_host`` / ``$RLBUS_METRICS_HOST`` — so Prometheus
    can reach it; `serve_metrics` then insists on a metrics token, ``$RLBUS_METRICS_TOKEN`` or
    ``$RLBUS_METRICS_TOKEN_FILE``, which docker-compose.yml sets: `rlbus.exposure`.)
    """

    def __init__(
        self,
        *,
        state: StateStore,
        role: str,
        worker_id: str,
        region: str = "",
        info: Info | None = None,
        every_s: float = 2.0,
        ttl_s: float = 10.0,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if every_s <= 0 or ttl_s <= every_s:
            raise ValueError("a heartbeat needs every_s > 0 and ttl_s > every_s, or workers would flicker")
        self._state = state
        self.role = role
        self.worker_id = worker_id
        self.region = region
        self._info = info
        self.every_s = every_s
        self.ttl_s = ttl_s
        self._clock = clock
        self.started_at = clock()
        self._host = socket.gethostname()
        self._version = rlbus_version()
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque([(self.started_at, 0.0)])  # (time, processed)
        self.beats = 0

    def payload(self, *, status: str = "running") -> dict[str, Any]:
        """What one beat carries: ``info()`` first, then the fields this class owns."""
        now = self._clock()
        info: dict[str, Any] = {}
        if self._info is not None:
            try:
                info = dict(self._info())
            except Exception as exc:  # a broken stats() must not silence the worker in the registry
                log.warning("heartbeat info of %s/%s failed: %r", self.role, self.worker_id, exc)
                info = {"info_error": repr(exc)}
        processed = info.get("processed")
        throughput = None
        if isinstance(processed, int | float):
            while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()  # keep one sample at or before the window's start
            since, before = self._samples[0]
            if now > since:
                throughput = (processed - before) / (now - since)
            self._samples.append((now, float(processed)))
        return jsonable(
            {
                **info,
                "role": self.role,
                "worker_id": self.worker_id,
                "region": self.region,
                "host": self._host,
                "pid": os.getpid(),
                "started_at": self.started_at,
                "uptime_s": now - self.started_at,
                "rlbus_version": self._version,
                "throughput": throughput,
                "status": status,
            }
        )

    async def beat(self, *, status: str = "running", ttl_s: float | None = None) -> dict[str, Any] | None:
        """Write one entry; returns it, or None when the store refused (logged, retried next beat)."""
        payload = self.payload(status=status)
        try:
            await self._state.heartbeat(self.role, self.worker_id, payload, ttl_s or self.ttl_s)
        except RlbusError as exc:
            log.warning("heartbeat of %s/%s not recorded: %s", self.role, self.worker_id, exc)
            return None
        self.beats += 1
        return payload

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.beat()
            await wait_event(stop, self.every_s)
        await self.beat(status="stopping", ttl_s=self.every_s)
