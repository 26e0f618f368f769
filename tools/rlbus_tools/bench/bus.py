"""``rlbus bench bus``: 16 KB rollout-sized messages end to end through a consumer group with commits.

Two measurements per bus, Kafka on loopback and the in-memory bus as the same-run baseline:
* throughput — a producer writes N messages as fast as acknowledgements allow (many sends in flight)
  while a group consumer reads, marks and commits per batch; msgs/s from first send to last commit;
* latency — the producer paces sends at a fixed rate (1,000 msg/s); each message carries its send time
  and the consumer records receive − send; p50/p99 over the run.

``--security tls-scram`` measures what security costs instead: the same two measurements on a fresh
PLAINTEXT cluster and on a fresh secure one of the same size (``kafka.start(secure=True, mtls=True)``:
SASL_SSL with SCRAM-SHA-512 and client certificates, ACLs enforced), one after the other on this machine,
as an ordinary role's credential (the namespace's operator, whose ACLs cover the benchmark's topics and
groups; the administrator creates the topics). Then it runs the refusal matrix
(:data:`rlbus_tools.chaos.intrusion.ATTEMPTS`) against the same secure cluster and counts the refusals.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from rlbus.bus.base import Bus
from rlbus.bus.memory import MemoryBus
from rlbus.bus.types import TopicSpec
from rlbus.errors import ConfigError
from rlbus.observe.stats import percentile
from rlbus_tools.bench.common import Bootstrap, JsonPath, Quick, meta, print_table, write_json

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


async def _measure(
    bus: Bus, n: int, rate: float, seconds: float, *, admin: Bus | None = None, replication: int = 1
) -> dict[str, float]:
    """Throughput and paced latency on two new topics (created through ``admin`` when the measured
    credential may not create topics)."""
    tput_topic = f"bench.bus.tput.{uuid.uuid4().hex[:8]}"
    lat_topic = f"bench.bus.lat.{uuid.uuid4().hex[:8]}"
    await (admin or bus).create_topics(
        [TopicSpec(tput_topic, partitions=6, replication=replication), TopicSpec(lat_topic, 6, replication)]
    )
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


def run(
    quick: bool, json_path: Path | None, bootstrap: str = "127.0.0.1:9092", security: str | None = None
) -> dict[str, Any]:
    if security is not None:
        if security != "tls-scram":
            raise ConfigError("security", f"{security!r}: the one security mode measured is tls-scram")
        return _run_security(quick, json_path)
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


# --- --security tls-scram -------------------------------------------------------------------------------


async def _secure_measure(brokers: int, n: int, seconds: float) -> tuple[dict[str, float], list[Any]]:
    from rlbus.bus.namespace import namespaced
    from rlbus.config import build_bus
    from rlbus_tools.chaos import intrusion

    async with intrusion.secure_cluster(brokers=brokers, mtls=True) as rig:
        namespace = intrusion.NAMESPACES[0]
        prefix = f"{namespace}."
        operator = build_bus(rig.bus_config(namespace, "operator"))
        async with namespaced(operator, prefix) as bus, namespaced(rig.admin_bus(), prefix) as admin:
            figures = await _measure(bus, n, 1000.0, seconds, admin=admin, replication=rig.cluster.replication_factor)
        outcomes = await intrusion.run_matrix(rig, redis_admin_url=os.environ.get("RLBUS_REDIS_URL"))
    return figures, outcomes


async def _plaintext_measure(brokers: int, n: int, seconds: float) -> dict[str, float]:
    import tempfile

    from rlbus.bus.kafka import KafkaBus, KafkaSettings
    from rlbus_tools.services import free_port_run, kafka

    with tempfile.TemporaryDirectory(prefix="rlbus-plain-") as home:
        cluster = await asyncio.to_thread(
            kafka.start, brokers=brokers, port=free_port_run(2 * brokers), fresh=True, home=Path(home), timeout_s=180
        )
        try:
            settings = KafkaSettings(bootstrap=cluster.bootstrap, client_id="rlbus-bench", linger_ms=2)
            async with KafkaBus(settings) as bus:
                return await _measure(bus, n, 1000.0, seconds, replication=cluster.replication_factor)
        finally:
            await asyncio.to_thread(kafka.stop, Path(home), 15.0)


def _run_security(quick: bool, json_path: Path | None) -> dict[str, Any]:
    brokers, n, seconds = (1, 5_000, 3.0) if quick else (3, 40_000, 10.0)
    plain = asyncio.run(_plaintext_measure(brokers, n, seconds))
    secure, outcomes = asyncio.run(_secure_measure(brokers, n, seconds))
    refused = [o for o in outcomes if o.refused]
    result: dict[str, Any] = {
        "plaintext": plain,
        "sasl_ssl": secure,
        "matrix": [vars(o) for o in outcomes],
        "summary": {
            "secure_msgs_per_s": secure["msgs_per_s"],
            "plaintext_msgs_per_s": plain["msgs_per_s"],
            "secure_p99_ms": secure["p99_ms"],
            "plaintext_p99_ms": plain["p99_ms"],
            "secure_vs_plaintext_throughput": secure["msgs_per_s"] / plain["msgs_per_s"],
            "attempts_tried": len(outcomes),
            "attempts_refused": len(refused),
            "attempts_logged": sum(1 for o in outcomes if o.logged),
            "attempts_wrote": sum(1 for o in outcomes if o.written),
        },
        "meta": {**meta(), "brokers": brokers, "message_bytes": MESSAGE_BYTES, "quick": quick,
                 "secure": "SASL_SSL (SCRAM-SHA-512) + client certificates, StandardAuthorizer"},
    }
    print_table(
        f"rlbus bench bus --security tls-scram — 16 KB messages, {brokers} broker(s), group consume + commit",
        ["listener", "msgs/s", "MB/s", "p50 ms @1k/s", "p99 ms @1k/s"],
        [
            ["SASL_SSL + mTLS + ACLs", secure["msgs_per_s"], secure["mb_per_s"], secure["p50_ms"], secure["p99_ms"]],
            ["PLAINTEXT (baseline)", plain["msgs_per_s"], plain["mb_per_s"], plain["p50_ms"], plain["p99_ms"]],
        ],
    )
    print_table(
        f"refusal matrix: {len(refused)} of {len(outcomes)} attempts refused",
        ["who", "tried", "result", "error", "wrote", "logged"],
        [o.row() for o in outcomes],
    )
    write_json(json_path, result)
    return result


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    bootstrap: Bootstrap = "127.0.0.1:9092",
    security: Annotated[str | None, typer.Option(
        help="tls-scram measures SASL_SSL + ACLs against PLAINTEXT (two fresh clusters) and runs the refusal matrix."
    )] = None,
) -> None:
    """Kafka against the in-memory bus: produce/consume throughput and latency (or the cost of TLS + SCRAM)."""
    run(quick=quick, json_path=json_path, bootstrap=bootstrap, security=security)
