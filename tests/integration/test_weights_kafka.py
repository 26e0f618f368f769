"""Weight sync over the real parts: manifests on Kafka, chunks over the signed HTTP store, two workers
(one following from the start, one joining late) ending bit-identical to the trainer."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import torch

from rlbus.blobs.http import BlobServer, HttpStore, serve
from rlbus.blobs.local import LocalStore
from rlbus.bus.topics import WEIGHTS, WEIGHTS_LATEST
from rlbus.weights.digest import state_digest
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync
from rlbus_tools.services import free_port
from tests.conftest import kafka_bus


async def test_publish_follow_and_late_join_over_kafka_and_http(tmp_path: Path) -> None:
    bus = await kafka_bus()
    secret = uuid.uuid4().hex
    port = free_port()
    runner = await serve(BlobServer(LocalStore(tmp_path / "origin"), secret=secret), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    model_id = f"test-{uuid.uuid4().hex[:8]}"  # the weights topics are shared: a fresh model id isolates us
    from rlbus.bus.topics import topic_specs

    await bus.create_topics([s for s in topic_specs() if s.name in (WEIGHTS.name, WEIGHTS_LATEST.name)])
    g = torch.Generator().manual_seed(0)
    master = {"w": torch.randn(256, 256, generator=g) * 0.02, "b": torch.zeros(256)}
    trainer_store, worker_store, late_store = (HttpStore(url, secret=secret) for _ in range(3))
    publisher = WeightPublisher(bus=bus, store=trainer_store, model_id=model_id, keyframe_every=4, store_url=url)
    blank = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in master.items()}
    follower = WeightSync(
        bus=bus, store=worker_store, model_id=model_id, state={k: v.clone() for k, v in blank.items()}
    )
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    try:
        await asyncio.sleep(1.0)
        for _ in range(6):
            for t in master.values():
                t.add_(torch.randn(t.shape, generator=g) * 1e-3)
            manifest = await publisher.publish(master, version=publisher.version + 1)
            for _ in range(300):
                if follower.version == manifest.version:
                    break
                await asyncio.sleep(0.02)
            assert follower.version == manifest.version
            assert follower.digest == manifest.model_digest == state_digest(publisher.snapshot(master))
        late = WeightSync(bus=bus, store=late_store, model_id=model_id, state={k: v.clone() for k, v in blank.items()})
        assert await late.catch_up()
        assert late.version == 6 and state_digest(late.state) == manifest.model_digest
        assert worker_store.bytes_fetched < 6 * publisher.history[0].full_bytes
    finally:
        stop.set()
        await task
        for store in (trainer_store, worker_store, late_store):
            await store.close()
        await runner.cleanup()
        await bus.close()
