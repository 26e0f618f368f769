"""What every role process reports: a Prometheus endpoint, event-loop lag and a registry heartbeat.

One `Observed` per process runs beside the worker in the role's TaskGroup. The heartbeat carries the
worker's ``stats()`` (and the weight sync's, for rollout workers) into the state store, where
``rlbus status`` and the dashboard read it; the endpoint serves every metric of
:mod:`rlbus.metrics` that the worker classes record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from rlbus.metrics import LoopLagMonitor, serve_metrics
from rlbus.observe.heartbeat import Heartbeat
from rlbus.state.base import StateStore

log = logging.getLogger("rlbus.launch.observed")


class Observed:
    def __init__(
        self,
        *,
        state: StateStore,
        role: str,
        worker_id: str,
        region: str | None,
        info: Callable[[], dict[str, Any]],
        metrics_port: int | None,
        metrics_host: str = "127.0.0.1",
        heartbeat_s: float = 2.0,
    ) -> None:
        self.loop_lag = LoopLagMonitor()
        self.heartbeat = Heartbeat(
            state=state, role=role, worker_id=worker_id, region=region or "",
            info=lambda: {**info(), **self.loop_lag.stats()}, every_s=heartbeat_s, ttl_s=5 * heartbeat_s,
        )
        self.worker_id = worker_id
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics_url: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        async with contextlib.AsyncExitStack() as stack:
            if self.metrics_port is not None:
                server = await stack.enter_async_context(serve_metrics(self.metrics_port, self.metrics_host))
                self.metrics_url = server.url
                log.info("%s: metrics on %s", self.worker_id, server.url)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.loop_lag.run(stop))
                tasks.create_task(self.heartbeat.run(stop))
