"""The gateway's wiring: the rollout stack's engine and weight sync, the recorders, the gateway — one builder.

`serve_stack` builds the same parts a rollout worker has (`rlbus.wiring.rollout.rollout_stack`: a bf16
copy of the run's model, the torch engine behind the batching engine, the `WeightSync` following
``rl.weights.v1`` when a blob store is given) and puts the gateway in front of its engine, so serving and
rollouts share one notion of "the version this engine serves". `run_serve` runs it all in one task group:
the gateway (with its recorders' drain tasks) and the weight sync. The trainer's version that admission
control compares against is the newest manifest the sync has seen announced.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus
from rlbus.bus.topics import REWARDS, ROLLOUTS, SERVED, topic_specs
from rlbus.serve.admission import Admission
from rlbus.serve.auth import Tenants
from rlbus.serve.gateway import Gateway
from rlbus.serve.recorder import ServedRecorder
from rlbus.serve.sessions import Sessions

if TYPE_CHECKING:
    from rlbus.models.sources import ModelSource
    from rlbus.wiring.rollout import RolloutStack

log = logging.getLogger("rlbus.serve.stack")


@dataclass
class ServeStack:
    gateway: Gateway
    rollout: RolloutStack
    recorder: ServedRecorder


def serve_stack(
    *,
    bus: Bus,
    source: ModelSource,
    tenants: Tenants,
    store: BlobStore | None = None,
    worker_id: str = "gateway",
    region: str = "",
    model_id: str = "policy",
    model_name: str | None = None,
    seed: int = 0,
    max_batch: int = 32,
    batch_window_s: float = 0.003,
    max_staleness: int | None = None,
    max_open_sessions: int = 1000,
    user_sessions: bool = False,
    buffer_records: int = 10_000,
    connect_bus: bool = False,
    create_topics: bool = False,
    default_max_tokens: int = 256,
) -> ServeStack:
    """A gateway over a fresh rollout stack of ``source``. ``connect_bus``: the bus is not started yet and
    may be unreachable — the recorders start it (and retry) themselves, so serving starts regardless;
    ``create_topics`` then also creates the served, rollout and reward topics."""
    from rlbus.wiring.rollout import rollout_stack

    parts = rollout_stack(bus=bus, store=store, model=source, worker_id=worker_id, seed=seed, region=region,
                          model_id=model_id, max_batch=max_batch, batch_window_s=batch_window_s)
    connector = _Connector(bus, create_topics=create_topics) if connect_bus else None
    recorder = ServedRecorder(bus=bus, topic=SERVED, capacity=buffer_records,
                              connect=None if connector is None else connector.connect)
    rollouts = ServedRecorder(bus=bus, topic=ROLLOUTS, capacity=buffer_records,
                              connect=None if connector is None else connector.connect)
    sync = parts.sync
    admission = Admission(max_staleness=max_staleness, max_open=max_open_sessions,
                          trainer_version=(lambda: sync.announced) if sync is not None else (lambda: None))
    gateway = Gateway(
        engine=parts.batching, chat=parts.chat, tenants=tenants, model_name=model_name or source.label,
        max_context=int(parts.weights.max_seq_len), recorder=recorder, rollouts=rollouts, bus=bus,
        admission=admission, sessions=Sessions(max_open=max_open_sessions), model_id=model_id, worker_id=worker_id,
        region=region, user_sessions=user_sessions, threads=max(8, 2 * max_batch),
        default_max_tokens=default_max_tokens, connect=None if connector is None else connector.connect,
        grammars=getattr(parts.engine, "grammars", None),
    )
    return ServeStack(gateway=gateway, rollout=parts, recorder=recorder)


class _Connector:
    """Starts a bus once, for whichever recorder asks first; a failed start is retried on the next ask. A
    standalone gateway also creates the topics it writes (existing ones are left alone)."""

    def __init__(self, bus: Bus, *, create_topics: bool = False) -> None:
        self._bus = bus
        self._lock = asyncio.Lock()
        self._create = create_topics
        self.started = False

    async def connect(self) -> None:
        async with self._lock:
            if self.started:
                return
            try:
                await self._bus.start()
                if self._create:
                    names = {SERVED.name, ROLLOUTS.name, REWARDS.name}
                    await self._bus.create_topics([t for t in topic_specs() if t.name.removesuffix(".dlq") in names])
            except BaseException:
                await self._bus.close()
                raise
            self.started = True


async def run_serve(stack: ServeStack, stop: asyncio.Event, *, host: str, port: int) -> None:
    """The gateway and (with a store) the weight sync, until ``stop``."""
    sync = stack.rollout.sync
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(stack.gateway.run(stop, host, port))
        if sync is not None:
            tasks.create_task(sync.run(stop))


async def standalone(
    source: ModelSource, tenants: Tenants, stop: asyncio.Event, *, bootstrap: str, host: str, port: int,
    model_name: str | None = None, user_sessions: bool = False, on_listening: asyncio.Event | None = None,
) -> ServeStack:
    """`rlbus serve` without a run config: ``source``'s own weights as v0, recording to the Kafka at
    ``bootstrap`` — connected in the background, so the gateway serves (and buffers) while it is down."""
    from rlbus.bus.kafka import KafkaBus, KafkaSettings

    bus = KafkaBus(KafkaSettings(bootstrap=bootstrap, client_id="rlbus-serve"))
    stack = serve_stack(bus=bus, source=source, tenants=tenants, model_name=model_name, user_sessions=user_sessions,
                        connect_bus=True, create_topics=True)
    try:
        await run_serve(stack, stop, host=host, port=port)
    finally:
        await bus.close()
    return stack
