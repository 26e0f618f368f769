"""Overlapped publishing (`rlbus.training.trainer`, "Overlapped publishing"): version N is encoded and uploaded
from its snapshot while step N+1 trains; versions are announced in order, at most one is in flight, and a
publish the store refuses loses nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus
from rlbus.bus.topics import WEIGHTS, topic_specs
from rlbus.errors import BlobStoreError
from rlbus.models.base import weight_tensors
from rlbus.models.policy import Policy
from rlbus.schemas import WeightVersion
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer
from rlbus.weights.digest import state_digest
from rlbus.weights.publish import WeightPublisher
from tests.unit.training.test_trainer_worker import CFG, groups


class SlowStore(LocalStore):
    """A local store whose puts take ``delay_s`` and can be made to fail; it records the order of puts."""

    def __init__(self, root: Path, delay_s: float = 0.0) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.failing = False
        self.puts: list[str] = []

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.sleep(self.delay_s)
        if self.failing:
            raise BlobStoreError("store down (test)")
        self.puts.append(key)
        await super().put(key, data)


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    instance = MemoryBus(topic_specs())
    await instance.start()
    yield instance
    await instance.close()


def overlapped(publisher: WeightPublisher, tmp_path: Path | None = None, every: int = 0) -> Trainer:
    torch.manual_seed(0)
    return Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-2), grpo=GRPOConfig(max_staleness=4),
                   publisher=publisher, overlap_publish=True, checkpoint_dir=tmp_path, checkpoint_every=every)


async def announced(bus: MemoryBus) -> list[WeightVersion]:
    async with bus.consumer([WEIGHTS], group=None) as consumer:
        return [r.value for r in await consumer.getmany(timeout_s=0.2)]


async def test_versions_publish_while_the_next_step_trains_in_order_and_bit_exact(
    bus: MemoryBus, tmp_path: Path
) -> None:
    store = SlowStore(tmp_path / "blobs", delay_s=0.05)
    publisher = WeightPublisher(bus=bus, store=store, keyframe_every=100)
    trainer = overlapped(publisher)
    digests = []
    for step in range(4):
        metrics = await trainer.train_on(groups(trainer.version, seed=step))
        digests.append(state_digest(WeightPublisher(bus=bus, store=store).snapshot(weight_tensors(trainer.model))))
        assert metrics["published"] is True
        # the step returned while its version is still being uploaded: the trainer did not wait for it
        assert trainer.version == step and publisher.version == step
        # the step's record names the version that holds its weights: the one in flight (as without overlap)
        assert metrics["version"] == step + 1
    await trainer.drain()
    assert trainer.version == publisher.version == 4
    manifests = [m for m in await announced(bus) if m.kind == "delta" or m.version == 1]
    assert [m.version for m in manifests] == [1, 2, 3, 4]
    assert [m.model_digest for m in manifests] == digests  # each version is the snapshot right after its step
    # one version at a time: every chunk of v(N+1) is put after v(N)'s manifest
    order = [int(k.split("/")[1]) for k in store.puts]
    assert order == sorted(order)


async def test_a_slow_publish_holds_the_next_one_back(bus: MemoryBus, tmp_path: Path) -> None:
    store = SlowStore(tmp_path / "blobs", delay_s=0.3)
    trainer = overlapped(WeightPublisher(bus=bus, store=store))
    first = await trainer.train_on(groups(0, seed=0))
    second = await trainer.train_on(groups(0, seed=1))
    assert first["publish_wait_s"] == 0.0
    assert second["publish_wait_s"] > 0.1  # back-pressure: v1 had to be announced before v2 was snapshotted
    assert trainer.version == 1  # v2 in flight
    await trainer.drain()
    assert trainer.version == 2


async def test_a_refused_publish_loses_nothing_and_the_next_one_takes_its_number(
    bus: MemoryBus, tmp_path: Path
) -> None:
    store = SlowStore(tmp_path / "blobs")
    publisher = WeightPublisher(bus=bus, store=store)
    trainer = overlapped(publisher, tmp_path / "ckpt", every=2)
    store.failing = True
    failed = await trainer.train_on(groups(0, seed=0))
    await trainer.drain()
    assert failed["published"] is False and trainer.version == publisher.version == 0
    assert await announced(bus) == []
    store.failing = False
    ok = await trainer.train_on(groups(0, seed=1))  # step 2 checkpoints: it waits for its version
    assert ok["published"] is True and ok["checkpointed"] is True
    assert trainer.version == publisher.version == 1
    assert [m.version for m in await announced(bus)] == [1]
