"""Claim checks over a real broker: a 2 MiB rollout (twice Kafka's default record limit) rides the blob
store and comes back whole, a small one is untouched, a corrupt and a missing claim end in the DLQ."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from typer.testing import CliRunner

from rlbus.blobs.local import LocalStore
from rlbus.bus import Record, Topic, TopicSpec
from rlbus.bus.claimcheck import H_CLAIM, ClaimCheckBus, reference
from rlbus.bus.dlq import DeadLetters, handle_batch, read_dead_letters
from rlbus.bus.topics import ROLLOUTS, dlq_spec, topic_specs
from rlbus.cli.app import app
from rlbus.schemas import Rollout, TensorData
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus


def rollout(i: int, tokens: int) -> Rollout:
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
        routed_experts=TensorData.from_numpy(rng.integers(0, 128, (48, tokens, 8)).astype(np.int16)),
    )


async def drain(consumer: Any, want: int, timeout_s: float = 20.0) -> list[Record[Any]]:
    out: list[Record[Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out += await consumer.getmany(timeout_s=0.5)
    return out


async def test_claims_round_trip_and_dead_letter_over_kafka(tmp_path: Path) -> None:
    topic = Topic(f"test.claims.{uuid.uuid4().hex[:8]}", Rollout, key=lambda m: m.prompt_id)
    store = LocalStore(tmp_path / "blobs")
    inner = await kafka_bus()  # started already: the wrapper is used without entering it
    bus = ClaimCheckBus(inner, store)
    try:
        spec = TopicSpec(topic.name, partitions=2)  # broker default max.message.bytes: 1 MiB
        await bus.create_topics([spec, dlq_spec(spec)])
        small, big, corrupt, missing = rollout(1, 50), rollout(2, 2800), rollout(3, 700), rollout(4, 700)
        assert len(topic.encode(big)[1]) > 2 * 1024 * 1024
        for message in (small, big, corrupt, missing):
            await bus.send(topic, message)
        assert bus.claims_written == 3 and len(await store.list()) == 3

        async with inner.consumer([topic]) as plain:
            on_log = {r.key: r for r in await drain(plain, 4)}
        assert on_log[b"p1"].raw == topic.encode(small)[1] and on_log[b"p1"].headers == ()
        assert on_log[b"p2"].raw == b"" and on_log[b"p2"].header(H_CLAIM) is not None

        def key_of(record: Record[Any]) -> str:
            ref = reference(record)
            assert ref is not None
            return ref.key

        await store.delete(key_of(on_log[b"p4"]))
        damaged = bytearray(await store.get(key_of(on_log[b"p3"])))
        damaged[100] ^= 0x01
        await store.put(key_of(on_log[b"p3"]), bytes(damaged))

        handled: dict[str, Rollout] = {}

        async def handler(record: Record[Any]) -> None:
            handled[record.value.rollout_id] = record.value

        dead = DeadLetters(bus)
        async with bus.consumer([topic]) as consumer:
            await handle_batch(consumer, await drain(consumer, 4), handler, dead, backoff_s=0.0)
        assert handled == {"p1/0": small, "p2/0": big}
        letters = {d.key: d for d in await read_dead_letters(bus, topic.name)}
        assert letters[b"p3"].error_class == "ClaimCorrupt" and "xxh3-128" in letters[b"p3"].error
        assert letters[b"p4"].error_class == "ClaimMissing" and key_of(on_log[b"p4"]) in letters[b"p4"].error
    finally:
        await inner.close()


def test_replay_cli_resolves_claims_given_the_store_and_shows_the_reference_without(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex[:8]
    big = msgspec.structs.replace(rollout(5, 2000), rollout_id=f"{marker}/0", prompt_id=marker)

    async def produce() -> int:
        inner = await kafka_bus()
        try:
            await inner.create_topics(topic_specs())
            before = await inner.end_offsets(ROLLOUTS.name)
            meta = await ClaimCheckBus(inner, LocalStore(tmp_path / "blobs")).send(ROLLOUTS, big)
            return before[meta.partition]
        finally:
            await inner.close()

    start = asyncio.run(produce())
    env = {"RLBUS_KAFKA_BOOTSTRAP": KAFKA_BOOTSTRAP}
    with_store, without = tmp_path / "resolved.jsonl", tmp_path / "plain.jsonl"
    for out, extra in ((with_store, ["--blobs", str(tmp_path / "blobs")]), (without, [])):
        args = ["replay", "--topic", ROLLOUTS.name, "--from", str(start), "--out", str(out), *extra]
        result = CliRunner().invoke(app, args, env=env)
        assert result.exit_code == 0, result.output

    def mine(path: Path) -> list[dict[str, Any]]:
        return [r for r in map(json.loads, path.read_text().splitlines()) if r["key"] == marker]

    (resolved,) = mine(with_store)
    assert resolved["value"]["rollout_id"] == f"{marker}/0" and resolved["value"]["routed_experts"]["shape"] == [
        48, 2000, 8]
    (plain,) = mine(without)
    assert "value" not in plain and json.loads(plain["headers"][H_CLAIM])["key"].startswith(f"claims/{ROLLOUTS.name}/")
