"""Publisher → blob store → manifests on the bus → workers that stage, swap and verify.

Runs on the in-memory bus and a local-directory store; tests/integration/test_weights_kafka.py runs the
same flow over Kafka and the HTTP store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rlbus.aio import until
from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus
from rlbus.bus.topics import WEIGHTS, topic_specs
from rlbus.weights.digest import state_digest
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync


class Trainer:
    """fp32 master weights moved by small Adam-like steps, so most bf16 elements stay put."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.master = {
            "embed.weight": torch.randn(300, 64, generator=g) * 0.02,
            "block.0.attn.weight": torch.randn(64, 64, generator=g) * 0.05,
            "block.0.norm.weight": torch.ones(64),
            "head.bias": torch.zeros(300),
        }

    def step(self, lr: float = 3e-3) -> None:
        for t in self.master.values():
            t.add_(torch.randn(t.shape, generator=self.g).sign() * lr * (torch.rand(t.shape, generator=self.g) < 0.2))


def worker_state(publisher: WeightPublisher, trainer: Trainer) -> dict[str, torch.Tensor]:
    """A worker's model before it has any version: right layout, garbage values."""
    return {k: torch.full_like(v, 7.0) for k, v in publisher.snapshot(trainer.master).items()}


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[MemoryBus, LocalStore]]:
    bus = MemoryBus(topic_specs())
    await bus.start()
    yield bus, LocalStore(tmp_path / "blobs")
    await bus.close()


async def publish(publisher: WeightPublisher, trainer: Trainer, n: int) -> list[str]:
    digests = []
    for _ in range(n):
        trainer.step()
        manifest = await publisher.publish(trainer.master, version=publisher.version + 1)
        digests.append(manifest.model_digest)
        assert manifest.model_digest == state_digest(publisher.snapshot(trainer.master))
    return digests


async def test_following_worker_is_bit_exact_every_version(setup: tuple[MemoryBus, LocalStore]) -> None:
    bus, store = setup
    trainer = Trainer()
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=3, chunk_bytes=16 * 1024)
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    stop = asyncio.Event()
    follower = asyncio.create_task(sync.run(stop))
    await asyncio.sleep(0.05)
    digests = []
    for _ in range(7):
        digests += await publish(publisher, trainer, 1)
        await until(lambda: sync.version == publisher.version, f"v{publisher.version} applied", every_s=0.01)
        assert sync.version == publisher.version and sync.digest == digests[-1]
    stop.set()
    await follower
    assert state_digest(sync.state) == digests[-1]
    assert [s.version for s in sync.history] == list(range(1, 8))
    deltas = [s for s in sync.history if s.kind == "delta"]
    assert deltas and all(not s.rebuilt for s in deltas)
    assert all(s.bytes_fetched < publisher.history[0].full_bytes for s in deltas)


async def test_late_joiner_rebuilds_from_keyframe_and_chain(setup: tuple[MemoryBus, LocalStore]) -> None:
    bus, store = setup
    trainer = Trainer(seed=1)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=4)
    digests = await publish(publisher, trainer, 6)
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    assert await sync.catch_up()
    assert sync.version == 6 and state_digest(sync.state) == digests[-1]
    assert [(s.version, s.kind) for s in sync.history] == [(4, "keyframe"), (5, "delta"), (6, "delta")]


async def test_worker_that_missed_versions_converges(setup: tuple[MemoryBus, LocalStore]) -> None:
    bus, store = setup
    trainer = Trainer(seed=2)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=100)
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    await publish(publisher, trainer, 2)
    assert await sync.catch_up() and sync.version == 2
    await publish(publisher, trainer, 3)  # the worker was away for v3..v5
    manifests = [r async for r in _weights(bus)]
    assert await sync.handle(manifests[-1])  # v5's delta has base v4: a gap, filled from the chain
    assert sync.version == 5 and sync.digest == manifests[-1].model_digest
    assert [s.version for s in sync.history if s.rebuilt] == [1, 2, 3, 4, 5]


async def test_corrupt_chunk_is_never_applied(setup: tuple[MemoryBus, LocalStore]) -> None:
    bus, store = setup
    trainer = Trainer(seed=3)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=3)
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    await publish(publisher, trainer, 2)
    await sync.catch_up()
    held = {k: v.clone() for k, v in sync.state.items()}
    await publish(publisher, trainer, 1)
    v3 = next(iter([m async for m in _weights(bus) if m.version == 3 and m.kind == "delta"]))
    key = v3.chunks[0].key
    data = bytearray(await store.get(key))
    data[len(data) // 2] ^= 0x40
    await store.put(key, bytes(data))
    # v3 is also a keyframe version, so the worker refuses the delta and rebuilds from v3's keyframe.
    assert await sync.handle(v3)
    assert sync.version == 3 and sync.digest == v3.model_digest
    assert sync.refused and "ChunkCorrupt" in sync.refused[0][1]
    # With the keyframe gone too, nothing is applied and the weights stay exactly as they were.
    sync2 = WeightSync(bus=bus, store=store, state={k: v.clone() for k, v in held.items()})
    sync2.version, sync2.digest = 2, state_digest(held)
    keyframes = [m async for m in _weights(bus) if m.version == 3 and m.kind == "keyframe"]
    for chunk in keyframes[0].chunks:
        await store.put(chunk.key, b"truncated")
    assert not await sync2.handle(v3)
    assert sync2.version == 2 and all(torch.equal(sync2.state[k], held[k]) for k in held)


async def test_old_versions_are_garbage_collected(setup: tuple[MemoryBus, LocalStore]) -> None:
    bus, store = setup
    trainer = Trainer(seed=4)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=5, retain_versions=3)
    await publish(publisher, trainer, 12)
    versions = sorted({int(k.split("/")[1]) for k in await store.list("policy/")})
    assert versions == [10, 11, 12]  # newest keyframe (10) and after; retention 3
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    assert await sync.catch_up() and sync.version == 12


async def test_swap_runs_through_the_engine_boundary(setup: tuple[MemoryBus, LocalStore]) -> None:
    bus, store = setup
    trainer = Trainer(seed=5)
    publisher = WeightPublisher(bus=bus, store=store)
    calls: list[int] = []

    async def at_boundary(fn):  # type: ignore[no-untyped-def]
        calls.append(1)
        fn()

    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer), swap=at_boundary)
    await publish(publisher, trainer, 2)
    await sync.catch_up()
    assert len(calls) == 2 and sync.version == 2


async def _weights(bus: MemoryBus) -> AsyncIterator:  # type: ignore[type-arg]
    async with bus.consumer([WEIGHTS], group=None) as consumer:
        for record in await consumer.getmany(timeout_s=0.1, max_records=10_000):
            yield record.value


async def test_double_buffered_swap_repoints_module_parameters(setup: tuple[MemoryBus, LocalStore]) -> None:
    from rlbus.weights.sync import bind_module, live_state

    bus, store = setup
    trainer = Trainer(seed=6)
    module = torch.nn.Module()
    for name, t in trainer.master.items():
        blank = torch.nn.Parameter(torch.zeros(t.shape, dtype=torch.bfloat16))
        module.register_parameter(name.replace(".", "_"), blank)
    trainer.master = {name.replace(".", "_"): t for name, t in trainer.master.items()}
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=50)
    sync = WeightSync(bus=bus, store=store, state=live_state(module), bind=bind_module(module))
    digests = await publish(publisher, trainer, 1)
    assert await sync.catch_up()
    for _ in range(3):
        digests += await publish(publisher, trainer, 1)
        manifest = [m async for m in _weights(bus)][-1]
        assert await sync.handle(manifest)
        # The module itself now computes with the new version, and the spare buffer is kept in step.
        assert state_digest({k: p.detach() for k, p in module.state_dict().items()}) == digests[-1]
        assert sync._spare is not None and state_digest(sync._spare) == digests[-1]
        assert sync._spare["head_bias"].data_ptr() != module.head_bias.data_ptr()
    # A pointer swap; the bound is loose because a loaded CI core stalls anything (the figure is benched).
    assert all(0 < s.swap_pause_s < 0.25 for s in sync.history)


class SlowStore(LocalStore):
    """A local store whose reads wait at a gate and count how many are in flight at once."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight: list[str] = []
        self.most_in_flight = 0
        #: The most versions whose chunks were downloading at one moment.
        self.most_versions_in_flight = 0
        self.keys: list[str] = []

    async def get(self, key: str) -> bytes:
        self.in_flight.append(key)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        versions = {k.split("/")[1] for k in self.in_flight if "manifest" not in k}
        self.most_versions_in_flight = max(self.most_versions_in_flight, len(versions))
        try:
            await self.gate.wait()
            await asyncio.sleep(0.005)
            self.keys.append(key)
            return await super().get(key)
        finally:
            self.in_flight.remove(key)


async def test_a_backlog_goes_straight_to_the_newest_version(tmp_path: Path) -> None:
    """A worker held up while many versions were announced (a healed partition) does not step through
    every one: it rebuilds to the newest from its keyframe, and is bit-exact there."""
    bus = MemoryBus(topic_specs())
    await bus.start()
    store = SlowStore(tmp_path / "blobs")
    trainer = Trainer(seed=5)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=10, retain_versions=40, chunk_bytes=8 * 1024)
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    stop = asyncio.Event()
    follower = asyncio.create_task(sync.run(stop))
    try:
        await publish(publisher, trainer, 2)
        await until(lambda: sync.version == 2, "v2 applied", every_s=0.01)
        store.gate.clear()  # v3's chunks hang: the manifests of v4..v24 queue up behind it
        digests = await publish(publisher, trainer, 22)
        await until(lambda: bool(store.in_flight), "v3 held up", every_s=0.01)
        store.gate.set()
        await until(lambda: sync.version == 24, "v24 applied", timeout_s=30, every_s=0.01)
    finally:
        stop.set()
        await follower
        await bus.close()
    assert sync.digest == digests[-1] and state_digest(sync.state) == digests[-1]
    assert [(s.version, s.kind) for s in sync.history] == [
        (1, "keyframe"), (2, "delta"), (3, "delta"), (20, "keyframe"), (21, "delta"), (22, "delta"),
        (23, "delta"), (24, "delta")]
    assert not any(f"/{v:010d}/" in key for v in range(4, 20) for key in store.keys)  # skipped, never fetched


async def test_a_rebuild_fetches_later_versions_while_applying_earlier_ones(setup: tuple[MemoryBus, LocalStore],
                                                                         tmp_path: Path) -> None:
    bus, _ = setup
    store = SlowStore(tmp_path / "slow")
    trainer = Trainer(seed=6)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=100, chunk_bytes=8 * 1024)
    digests = await publish(publisher, trainer, 9)
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer), fetch_parallelism=4)
    await sync.rebuild(9)
    assert sync.version == 9 and state_digest(sync.state) == digests[-1]
    assert [s.version for s in sync.history] == list(range(1, 10))
    assert store.most_in_flight == 4  # the parallelism bound: filled, never exceeded
    assert store.most_versions_in_flight >= 2  # later versions' chunks downloading while earlier ones apply


async def test_a_chain_with_a_missing_version_fails_cleanly(setup: tuple[MemoryBus, LocalStore]) -> None:
    """A delta gone from the store mid-chain: the rebuild is refused, nothing half-applied is called a
    version, and no prefetch is left running or unretrieved."""
    bus, store = setup
    trainer = Trainer(seed=7)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=100, chunk_bytes=8 * 1024)
    await publish(publisher, trainer, 6)
    for path in (store.root / "policy" / f"{5:010d}").iterdir():
        if not path.name.startswith("manifest"):
            path.unlink()  # v5's chunks lost; its manifest still says what they were
    sync = WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer))
    manifests = [r async for r in _weights(bus)]
    assert not await sync.handle(manifests[-1])
    assert sync.version == 4 and sync.refused and "BlobNotFound" in sync.refused[-1][1]
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending


async def test_workers_of_one_process_decode_each_chunk_once(setup: tuple[MemoryBus, LocalStore]) -> None:
    """Three workers on the same weights share one decode of every delta chunk and end bit-identical."""
    from rlbus.weights.staging import StagingCache

    bus, store = setup
    trainer = Trainer(seed=5)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=100, chunk_bytes=4096)
    staging = StagingCache()
    syncs = [WeightSync(bus=bus, store=store, state=worker_state(publisher, trainer), staging=staging)
             for _ in range(3)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in syncs]
    digests = await publish(publisher, trainer, 1)
    await until(lambda: all(s.version == 1 for s in syncs), "all on v1", timeout_s=10)
    before = staging.decoded
    digests += await publish(publisher, trainer, 2)
    await until(lambda: all(s.version == 3 for s in syncs), "all on v3", timeout_s=10)
    stop.set()
    await asyncio.gather(*tasks)
    chunks = sum([len(m.chunks) async for m in _weights(bus) if m.kind == "delta" and m.version > 1])
    assert staging.decoded - before == chunks and staging.shared >= 2 * chunks
    assert all(s.digest == digests[-1] for s in syncs)
    assert all(torch.equal(s.state[k], syncs[0].state[k]) for s in syncs for k in s.state)
