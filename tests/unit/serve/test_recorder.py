"""The served-record buffer: nothing blocks or raises while the bus is down, records flush in order once
it returns, a full buffer drops its oldest records and counts them."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from rlbus.aio import until
from rlbus.bus import MemoryBus
from rlbus.bus.topics import SERVED, topic_specs
from rlbus.errors import BusUnavailable
from rlbus.schemas import Served, ServedParams, TensorData
from rlbus.serve.recorder import ServedRecorder


class FlakyBus(MemoryBus):
    """The in-memory bus with an outage switch: while ``down``, every send fails as Kafka's would."""

    down = False

    async def send_raw(self, topic: str, value: bytes, **kwargs: Any) -> Any:
        if self.down:
            raise BusUnavailable(f"produce to {topic}: broker unreachable")
        return await super().send_raw(topic, value, **kwargs)


def served(i: int) -> Served:
    ids = TensorData.from_numpy(np.asarray([i], dtype=np.int32))
    return Served(served_id=f"chatcmpl-{i}", request_id=f"r{i}", tenant="acme", prompt_ids=ids, token_ids=ids,
                  logprobs=TensorData.from_numpy(np.zeros(1, dtype=np.float32)), token_versions=ids,
                  params=ServedParams(max_tokens=1), finish_reason="stop")


async def written(bus: MemoryBus) -> list[str]:
    async with bus.consumer([SERVED], group=None) as consumer:
        records = await consumer.getmany(timeout_s=0.05, max_records=1000)
    return [r.value.served_id for r in sorted(records, key=lambda r: (r.partition, r.offset))]


async def test_buffers_while_down_and_flushes_when_back() -> None:
    async with FlakyBus([s for s in topic_specs() if s.name == SERVED.name]) as bus:
        bus.down = True
        recorder = ServedRecorder(bus=bus, capacity=100, batch=4, retry_s=0.01)
        for i in range(10):
            recorder.record(served(i))
        assert not await recorder.flush()
        assert (recorder.buffered, recorder.recorded, recorder.dropped, recorder.down) == (10, 0, 0, True)
        assert recorder.last_error is not None and "unreachable" in recorder.last_error
        bus.down = False
        assert await recorder.flush()
        assert (recorder.buffered, recorder.recorded, recorder.down) == (0, 10, False)
        assert sorted(await written(bus), key=lambda s: int(s.split("-")[1])) == [f"chatcmpl-{i}" for i in range(10)]


async def test_a_full_buffer_drops_the_oldest_and_counts() -> None:
    async with FlakyBus(topic_specs()) as bus:
        bus.down = True
        recorder = ServedRecorder(bus=bus, capacity=3, batch=2)
        for i in range(5):
            recorder.record(served(i))
        assert not await recorder.flush()
        assert (recorder.buffered, recorder.dropped) == (3, 2)
        bus.down = False
        assert await recorder.flush()
        assert sorted(await written(bus)) == ["chatcmpl-2", "chatcmpl-3", "chatcmpl-4"]


async def test_run_connects_late_and_drains_on_stop() -> None:
    async with FlakyBus(topic_specs()) as bus:
        attempts = 0

        async def connect() -> None:
            nonlocal attempts
            attempts += 1
            if attempts < 3:
                raise BusUnavailable("connect to Kafka: refused")

        recorder = ServedRecorder(bus=bus, retry_s=0.01, drain_s=0.05, connect=connect)
        stop = asyncio.Event()
        task = asyncio.create_task(recorder.run(stop))
        for i in range(3):
            recorder.record(served(i))
        await until(lambda: recorder.recorded == 3, "three records written")
        assert attempts == 3
        bus.down = True
        recorder.record(served(3))
        stop.set()
        await task
        assert recorder.unflushed == 1 and recorder.recorded == 3


class GatedBus(MemoryBus):
    """The in-memory bus whose sends wait for ``gate``: a broker slow to acknowledge."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()

    async def send_raw(self, topic: str, value: bytes, **kwargs: Any) -> Any:
        await self.gate.wait()
        return await super().send_raw(topic, value, **kwargs)


async def test_flush_waits_for_the_sends_the_drain_task_has_in_flight() -> None:
    async with GatedBus(topic_specs()) as bus:
        recorder = ServedRecorder(bus=bus)
        stop = asyncio.Event()
        task = asyncio.create_task(recorder.run(stop))
        for i in range(3):
            recorder.record(served(i))
        await until(lambda: recorder.buffered == 3 and not recorder._buffer, "the drain task sending all three")
        flushing = asyncio.create_task(recorder.flush())
        await asyncio.sleep(0.05)
        assert not flushing.done()  # the buffer is empty, but nothing is acknowledged yet
        bus.gate.set()
        assert await asyncio.wait_for(flushing, 5) is True
        assert recorder.recorded == 3 and sorted(await written(bus)) == [f"chatcmpl-{i}" for i in range(3)]
        stop.set()
        await task
