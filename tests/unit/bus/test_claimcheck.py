"""Claim checks on the in-memory bus: small messages untouched, large ones through the blob store and back,
and every way a claim can fail ends in the DLQ with its reason (rlbus/bus/claimcheck.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus, Record, TopicPartition
from rlbus.bus.claimcheck import H_CLAIM, ClaimCheckBus, collect_claims, pack, payload, unpack
from rlbus.bus.dlq import DeadLetters, handle_batch, read_dead_letters, redrive
from rlbus.bus.replay import read_window, record_to_json
from rlbus.bus.topics import ROLLOUTS, topic_specs
from rlbus.errors import BlobStoreError, ClaimCorrupt, ClaimUnavailable
from rlbus.schemas import BlobRef, Rollout, TensorData

THRESHOLD = 4096
NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def rollout(i: int, tokens: int, layers: int = 4, top_k: int = 2) -> Rollout:
    rng = np.random.default_rng(i)
    return Rollout(
        rollout_id=f"p{i}/0",
        prompt_id=f"p{i}",
        group_index=0,
        group_size=1,
        token_ids=TensorData.from_numpy(rng.integers(0, 1000, tokens).astype(np.int32)),
        loss_mask=TensorData.from_numpy(np.ones(tokens, np.uint8)),
        logprobs=TensorData.from_numpy(rng.normal(-1, 0.3, tokens).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.zeros(tokens, np.int32)),
        routed_experts=TensorData.from_numpy(rng.integers(0, 64, (layers, tokens, top_k)).astype(np.int16)),
    )


@pytest.fixture
async def inner() -> Any:
    bus = MemoryBus(topic_specs(partitions=3))
    await bus.start()
    yield bus
    await bus.close()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "blobs")


def claims_bus(inner: MemoryBus, store: Any, **kwargs: Any) -> ClaimCheckBus:
    return ClaimCheckBus(inner, store, threshold_bytes=THRESHOLD, clock=lambda: NOW, backoff_s=0.0, **kwargs)


async def read_all(bus: Any, topic: Any, want: int) -> list[Record[Any]]:
    out: list[Record[Any]] = []
    async with bus.consumer([topic]) as consumer:
        for _ in range(20):
            out += await consumer.getmany(timeout_s=0.05)
            if len(out) >= want:
                break
    return sorted(out, key=lambda r: (r.partition, r.offset))


async def test_below_threshold_is_byte_identical(inner: MemoryBus, store: LocalStore) -> None:
    small = rollout(1, tokens=16)
    _, expected = ROLLOUTS.encode(small)
    assert len(expected) <= THRESHOLD
    bus = claims_bus(inner, store)
    via_claims = await bus.send(ROLLOUTS, small, headers=(("trace", b"t1"),))
    plain = await inner.send(ROLLOUTS, small, headers=(("trace", b"t1"),))
    first, second = await read_all(inner, ROLLOUTS, 2)
    assert (first.raw, first.key, first.headers) == (second.raw, second.key, second.headers)
    assert first.raw == expected and first.headers == (("trace", b"t1"),)
    assert via_claims.partition == plain.partition
    assert await store.list() == [] and bus.claims_written == 0
    through = await read_all(bus, ROLLOUTS, 2)
    assert [r.value for r in through] == [small, small] and [r.raw for r in through] == [expected, expected]


async def test_above_threshold_round_trip(inner: MemoryBus, store: LocalStore) -> None:
    big = rollout(2, tokens=2000)
    _, encoded = ROLLOUTS.encode(big)
    bus = claims_bus(inner, store)
    meta = await bus.send(ROLLOUTS, big, headers=(("trace", b"t2"),))

    (on_log,) = await read_all(inner, ROLLOUTS, 1)
    assert on_log.raw == b"" and on_log.key == b"p2" and meta.partition == on_log.partition
    ref = BlobRef(**json.loads(on_log.header(H_CLAIM) or b""))
    assert ref.key == f"claims/{ROLLOUTS.name}/20260101T00/{ref.hash}" and ref.codec == "zstd"
    assert await store.list() == [ref.key] and await store.size(ref.key) == ref.size < len(encoded)

    (resolved,) = await read_all(bus, ROLLOUTS, 1)
    assert resolved.value == big
    assert resolved.raw == b"" and resolved.header("trace") == b"t2"  # the log's bytes, for DLQ and redrive
    assert payload(resolved) == encoded


async def test_default_threshold_claims_a_moe_rollout_over_512_kib(inner: MemoryBus, store: LocalStore) -> None:
    """48 layers × top-8 routing passes 512 KiB at about 670 tokens (the measured figure)."""
    bus = ClaimCheckBus(inner, store)
    under, over = rollout(3, tokens=600, layers=48, top_k=8), rollout(4, tokens=700, layers=48, top_k=8)
    assert len(ROLLOUTS.encode(under)[1]) <= 512 * 1024 < len(ROLLOUTS.encode(over)[1])
    await bus.send(ROLLOUTS, under)
    await bus.send(ROLLOUTS, over)
    assert bus.claims_written == 1
    got = {r.value.rollout_id: r for r in await read_all(bus, ROLLOUTS, 2)}
    assert got["p3/0"].value == under and got["p3/0"].header(H_CLAIM) is None
    assert got["p4/0"].value == over and got["p4/0"].header(H_CLAIM) is not None


async def dead_letter_everything(bus: ClaimCheckBus) -> tuple[list[str], DeadLetters]:
    """Consume ROLLOUTS as a worker does; returns the rollout ids handled and the DLQ writer."""
    handled: list[str] = []

    async def handler(record: Record[Any]) -> None:
        handled.append(record.value.rollout_id)

    dead = DeadLetters(bus)
    async with bus.consumer([ROLLOUTS], group="trainer") as consumer:
        batch = await consumer.getmany(timeout_s=0.1)
        await handle_batch(consumer, batch, handler, dead, backoff_s=0.0)
        committed = await consumer.commit()
    ends: dict[Any, int] = {}
    for record in batch:
        ends[record.tp] = max(ends.get(record.tp, 0), record.offset + 1)
    assert batch and committed == ends  # every record marked: handled or dead-lettered
    return handled, dead


async def test_hash_mismatch_goes_to_the_dlq(inner: MemoryBus, store: LocalStore) -> None:
    bus = claims_bus(inner, store)
    await bus.send(ROLLOUTS, rollout(5, tokens=16))
    await bus.send(ROLLOUTS, rollout(6, tokens=2000))
    (key,) = await store.list()
    stored = bytearray(await store.get(key))
    stored[len(stored) // 2] ^= 0xFF  # same size, one flipped byte
    await store.put(key, bytes(stored))

    handled, dead = await dead_letter_everything(bus)
    assert handled == ["p5/0"] and dead.counts == {"ClaimCorrupt": 1}
    (letter,) = await read_dead_letters(inner, ROLLOUTS.name)
    assert letter.error_class == "ClaimCorrupt" and key in letter.error and "xxh3-128" in letter.error
    assert letter.value == b"" and dict(letter.original_headers)[H_CLAIM]  # the reference, not the payload


async def test_missing_blob_goes_to_the_dlq_and_redrives_once_restored(
    inner: MemoryBus, store: LocalStore
) -> None:
    bus = claims_bus(inner, store)
    big = rollout(7, tokens=2000)
    await bus.send(ROLLOUTS, big)
    (key,) = await store.list()
    kept = await store.get(key)
    await store.delete(key)

    handled, dead = await dead_letter_everything(bus)
    assert handled == [] and dead.counts == {"ClaimMissing": 1}
    (letter,) = await read_dead_letters(inner, ROLLOUTS.name)
    assert letter.error_class == "ClaimMissing" and key in letter.error

    await store.put(key, kept)
    assert await redrive(bus, ROLLOUTS.name) == 1
    handled, dead = await dead_letter_everything(bus)
    assert handled == ["p7/0"] and dead.counts == {}


class FlakyStore(LocalStore):
    """Fails ``failures`` reads with a retriable store error, then behaves."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures = failures
        self.reads = 0

    async def get(self, key: str) -> bytes:
        self.reads += 1
        if self.reads <= self.failures:
            raise BlobStoreError("connection reset")
        return await super().get(key)


async def test_a_flaky_store_is_retried_and_a_dead_one_dead_letters(inner: MemoryBus, tmp_path: Path) -> None:
    flaky = FlakyStore(tmp_path / "a", failures=2)
    bus = claims_bus(inner, flaky, attempts=3)
    big = rollout(8, tokens=2000)
    await bus.send(ROLLOUTS, big)
    (record,) = await read_all(bus, ROLLOUTS, 1)
    assert record.value == big and flaky.reads == 3

    flaky.reads, flaky.failures = 0, 10
    (record,) = await read_all(bus, ROLLOUTS, 1)
    with pytest.raises(ClaimUnavailable, match="after 3 attempt"):
        record.value  # noqa: B018
    assert flaky.reads == 3


async def test_forged_reference_is_refused_without_reading_the_store(inner: MemoryBus, store: LocalStore) -> None:
    await store.put("policy/0000000001/chunk-0", b"weights")
    ref = BlobRef(key="policy/0000000001/chunk-0", size=7, hash="0" * 32, codec="identity")
    await inner.send_raw(ROLLOUTS.name, b"", key=b"p9", headers=((H_CLAIM, msgspec.json.encode(ref)),))
    (record,) = await read_all(claims_bus(inner, store), ROLLOUTS, 1)
    with pytest.raises(ClaimCorrupt, match="not under 'claims/'"):
        record.value  # noqa: B018


def test_unpack_checks_size_hash_and_codec() -> None:
    ref, stored = pack("t", b"x" * 10_000, now=NOW)
    assert unpack(ref, stored) == b"x" * 10_000
    with pytest.raises(ClaimCorrupt, match="bytes stored"):
        unpack(ref, stored[:-1])
    with pytest.raises(ClaimCorrupt, match="unknown codec"):
        unpack(BlobRef(key=ref.key, size=ref.size, hash=ref.hash, codec="lz5"), stored)


async def test_replay_resolves_claims_and_shows_the_reference_without_a_store(
    inner: MemoryBus, store: LocalStore
) -> None:
    bus = claims_bus(inner, store)
    big = rollout(10, tokens=2000)
    await bus.send(ROLLOUTS, big)
    resolved = [record_to_json(r) async for r in read_window(bus, ROLLOUTS.name)]
    assert [r["value"]["rollout_id"] for r in resolved] == ["p10/0"]
    (plain,) = [record_to_json(r) async for r in read_window(inner, ROLLOUTS.name)]
    assert json.loads(plain["headers"][H_CLAIM])["key"].startswith(f"claims/{ROLLOUTS.name}/")


async def test_payload_of_an_untyped_consumer(inner: MemoryBus, store: LocalStore) -> None:
    bus = claims_bus(inner, store)
    big = rollout(11, tokens=2000)
    await bus.send(ROLLOUTS, big)
    (record,) = await read_all(bus, ROLLOUTS.name, 1)
    assert payload(record) == ROLLOUTS.encode(big)[1]


async def test_collect_claims_deletes_whole_hours_older_than_the_retention(store: LocalStore) -> None:
    hour = 3600.0
    for age_h in (0, 5, 30):
        ref, stored = pack(ROLLOUTS.name, f"payload {age_h}".encode() * 100, now=NOW - age_h * hour)
        await store.put(ref.key, stored)
    await store.put("claims/odd-key", b"?")
    await store.put("policy/0000000001/chunk-0", b"weights")
    deleted = await collect_claims(store, older_than_s=24 * hour, now=NOW)
    assert [k.split("/")[2] for k in deleted] == ["20251230T18"]
    deleted = await collect_claims(store, older_than_s=4 * hour + 1, now=NOW)
    assert [k.split("/")[2] for k in deleted] == []  # the 5 h bucket ends 4 h ago: not entirely older
    deleted = await collect_claims(store, older_than_s=4 * hour, now=NOW)
    assert [k.split("/")[2] for k in deleted] == ["20251231T19"]
    assert len(await store.list()) == 3  # the newest claim, the odd key and the weights


async def test_consumer_bookkeeping_goes_to_the_inner_consumer(inner: MemoryBus, store: LocalStore) -> None:
    """Marks, commits, positions and lag are the inner consumer's, so its rebalance listener commits them."""
    bus = claims_bus(inner, store)
    for i in range(3):
        await bus.send(ROLLOUTS, rollout(20 + i, tokens=2000 if i else 16))
    async with bus.consumer([ROLLOUTS], group="g") as consumer:
        records = await consumer.getmany(timeout_s=0.1)
        assert len(records) == 3
        for record in records:
            consumer.mark(record)
        assert consumer.inner._marked and await consumer.lag() == await consumer.inner.lag()
        committed = await consumer.commit()
        assert committed and await consumer.lag() == {tp: 0 for tp in consumer.assignment()}
        for tp, offset in committed.items():
            assert await consumer.position(tp) == offset == await consumer.committed(tp)
    assert await inner.committed("g", ROLLOUTS.name) == {
        p: committed.get(TopicPartition(ROLLOUTS.name, p)) for p in await inner.partitions(ROLLOUTS.name)
    }
