"""Shared fixtures: the in-memory bus and a real Kafka bus behind one ``bus`` fixture.

Kafka is reached at ``RLBUS_KAFKA_BOOTSTRAP`` (default ``127.0.0.1:9092``; ``make test`` starts a
local broker). When it is unreachable the Kafka tests *fail* with a clear message — they never skip,
so a CI run without Kafka cannot pass by accident. Every test gets fresh, uniquely named topics.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any test module imports
# one (collection imports them all, in an order no module controls): without a GPU its kernels run only under
# the interpreter, on CPU tensors (tests/unit/weights/test_codec_device.py). On a GPU (make gpu-check) the
# compiled kernels run; the interpreted tests set it themselves.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rlbus.bus import Bus, MemoryBus, TopicSpec

pytest_plugins = ["tests.fixtures.redis", "tests.fixtures.hf"]

#: Fixture data, not tests: the swe fixtures' repositories carry their own (hidden) test files, which run only
#: inside the sandbox, against their task's code.
collect_ignore = ["fixtures"]

KAFKA_BOOTSTRAP = os.environ.get("RLBUS_KAFKA_BOOTSTRAP", "127.0.0.1:9092")


async def kafka_bus() -> Bus:
    from rlbus.bus.kafka import KafkaBus, KafkaSettings
    from rlbus.errors import BusUnavailable

    bus = KafkaBus(KafkaSettings(bootstrap=KAFKA_BOOTSTRAP, client_id="rlbus-tests", request_timeout_ms=15_000))
    try:
        await bus.start()
    except BusUnavailable as exc:
        await bus.close()
        pytest.fail(
            f"Kafka is not reachable at {KAFKA_BOOTSTRAP} ({exc}). Start it with `rlbus kafka start` "
            "or set RLBUS_KAFKA_BOOTSTRAP; Kafka tests fail rather than skip.",
            pytrace=False,
        )
    return bus


@pytest.fixture(params=["memory", "kafka"])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[Bus]:
    """The bus under the contract: each test runs once per implementation."""
    instance: Bus = MemoryBus() if request.param == "memory" else await kafka_bus()
    if request.param == "memory":
        await instance.start()
    try:
        yield instance
    finally:
        await instance.close()


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    instance = MemoryBus()
    await instance.start()
    yield instance
    await instance.close()


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Unique names for topics and groups, so tests never see each other's data on a shared broker."""
    run = uuid.uuid4().hex[:8]
    return lambda name: f"test.{name}.{run}"


@pytest.fixture
def make_topic(bus: Bus, unique: Callable[[str], str]) -> Callable[..., object]:
    async def create(name: str, partitions: int = 3, **config: str) -> str:
        full = unique(name)
        await bus.create_topics([TopicSpec(full, partitions=partitions, config=dict(config))])
        return full

    return create


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files that hold a ``slow`` test run first. `make test` spreads files over workers (pytest-xdist,
    ``--dist loadfile``: a file at a time per worker, handed out in collection order), so the long scenarios
    start at once and the many short files fill in around them; collected last, one of them would run alone
    at the end while the other worker idled. The order within a file is kept."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
