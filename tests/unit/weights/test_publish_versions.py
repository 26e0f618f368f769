"""The trainer numbers versions; the publisher refuses to go backwards and bases each delta on the version
it published last (a restored trainer may jump ahead)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbus.blobs.local import LocalStore
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.weights.publish import WeightPublisher


async def test_versions_never_repeat_and_deltas_base_on_the_last_published(tmp_path: Path) -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    publisher = WeightPublisher(bus=bus, store=LocalStore(tmp_path), keyframe_every=100)
    master = {"w": torch.randn(64, 64)}
    first = await publisher.publish(master, version=1)
    assert (first.kind, publisher.version) == ("keyframe", 1)
    master["w"][0, 0] += 1.0
    jumped = await publisher.publish(master, version=4)  # e.g. continuing after a run's newest version
    assert (jumped.kind, jumped.base_version, publisher.version) == ("delta", 1, 4)
    with pytest.raises(ValueError, match="versions never repeat"):
        await publisher.publish(master, version=4)
    await bus.close()
