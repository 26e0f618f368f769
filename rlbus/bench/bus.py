"""``rlbus bench bus``: 16 KB rollout-sized messages end to end through a consumer group with commits.

Two measurements per bus, Kafka on loopback and the in-memory bus as the same-run baseline:
* throughput — a producer writes N messages as fast as acknowledgements allow (many sends in flight)
  while a group consumer reads, marks and commits per batch; msgs/s from first send to last commit;
* latency — the producer paces sends at a fixed rate (1,000 msg/s); each message carries its send time
  and the consumer records receive − send; p50/p99 over the run.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Any

from rlbus.bench.common import meta, print_table, write_json
from rlbus.bus.base import Bus
from rlbus.bus.memory import MemoryBus
from rlbus.bus.types import TopicSpec
from rlbus.observe.stats import percentile

MESSAGE_BYTES = 16 * 1024


def _payload(seq: int, filler: bytes) -> bytes:
    return struct.pack("<qd", seq, time.perf_counter()) + filler


async def _consume(
    bus: Bus, topic: str, group: str, want: int, latencies: list[float] | None, joined: asyncio.Event
) -> float:
    """Read ``want`` messages, committing per batch; ``joined`` is set once the group gave us partitions,
    so the producer starts only then and no measurement includes the first rebalance."""
    received = 0
    async with bus.consumer([topic], group=group) as consumer:
        while received < want:
            if consumer.assignment():
                joined.set()
            batch = await consumer.getmany(timeout_s=1.0, max_records=2000)
            now = time.perf_counter()
            for record in batch:
                if latencies is not None:
                    _, sent = struct.unpack_from("<qd", record.raw)
                    latencies.append((now - sent) * 1000)
                consumer.mark(record)
            received += len(batch)
            if batch:
                await consumer.commit()
    return time.perf_counter()


async def throughput(bus: Bus, topic: str, n: int, in_flight: int = 256) -> float:
    filler = os.urandom(MESSAGE_BYTES - 16)
    group = f"bench-tput-{uuid.uuid4().hex[:6]}"
    joined = asyncio.Event()
    consumer = asyncio.create_task(_consume(bus, topic, group, n, None, joined))
    async with asyncio.timeout(60):
        await joined.wait()
    start = time.perf_counter()
    window = asyncio.Semaphore(in_flight)

    async def send(i: int) -> None:
        async with window:
            await bus.send_raw(topic, _payload(i, filler), key=f"prompt-{i % 512}".encode())

    await asyncio.gather(*(send(i) for i in range(n)))
    end = await consumer
    return n / (end - start)


async def latency(bus: Bus, topic: str, rate: float, seconds: float) -> list[float]:
    filler = os.urandom(MESSAGE_BYTES - 16)
    group = f"bench-lat-{uuid.uuid4().hex[:6]}"
    n = int(rate * seconds)
    latencies: list[float] = []
    joined = asyncio.Event()
    consumer = asyncio.create_task(_consume(bus, topic, group, n, latencies, joined))
    async with asyncio.timeout(60):
        await joined.wait()
    pending: set[asyncio.Task[Any]] = set()
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(bus.send_raw(topic, _payload(i, filler), key=f"prompt-{i % 512}".encode()))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)
    await consumer
    return latencies[n // 10 :]  # drop the warm-up tenth


async def _measure(bus: Bus, n: int, rate: float, seconds: float) -> dict[str, float]:
    tput_topic = f"bench.bus.tput.{uuid.uuid4().hex[:8]}"
    lat_topic = f"bench.bus.lat.{uuid.uuid4().hex[:8]}"
    await bus.create_topics([TopicSpec(tput_topic, partitions=6), TopicSpec(lat_topic, partitions=6)])
    msgs_per_s = await throughput(bus, tput_topic, n)
    lat = await latency(bus, lat_topic, rate, seconds)
    return {
        "msgs_per_s": msgs_per_s,
        "mb_per_s": msgs_per_s * MESSAGE_BYTES / 1e6,
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "rate": rate,
        "messages": n,
    }


async def _run(bootstrap: str, quick: bool) -> dict[str, Any]:
    from rlbus.bus.kafka import KafkaBus, KafkaSettings

    n, seconds = (5_000, 3.0) if quick else (40_000, 10.0)
    async with MemoryBus() as memory:
        memory_result = await _measure(memory, n, 1000.0, seconds)
    async with KafkaBus(KafkaSettings(bootstrap=bootstrap, client_id="rlbus-bench", linger_ms=2)) as kafka:
        kafka_result = await _measure(kafka, n, 1000.0, seconds)
    return {"kafka": kafka_result, "memory": memory_result}


def run(quick: bool, json_path: Path | None, bootstrap: str = "127.0.0.1:9092") -> dict[str, Any]:
    result = asyncio.run(_run(bootstrap, quick))
    k, m = result["kafka"], result["memory"]
    result["targets"] = {
        "kafka_msgs_per_s>=5000": k["msgs_per_s"] >= 5000,
        "kafka_p99_ms<50_at_1000": k["p99_ms"] < 50,
    }
    result["kafka_vs_memory_throughput"] = k["msgs_per_s"] / m["msgs_per_s"]
    result["meta"] = {**meta(), "bootstrap": bootstrap, "message_bytes": MESSAGE_BYTES, "quick": quick}
    print_table(
        "rlbus bench bus — 16 KB messages, group consume + commit",
        ["bus", "msgs/s", "MB/s", "p50 ms @1k/s", "p99 ms @1k/s"],
        [
            ["kafka (loopback)", k["msgs_per_s"], k["mb_per_s"], k["p50_ms"], k["p99_ms"]],
            ["memory (baseline)", m["msgs_per_s"], m["mb_per_s"], m["p50_ms"], m["p99_ms"]],
        ],
    )
    write_json(json_path, result)
    return result
