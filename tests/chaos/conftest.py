"""The chaos suite's private infrastructure: one three-broker Kafka cluster and one Redis per session.

Started here, in a temporary directory on free ports (about 20-60 s on two cores), never the Kafka on
9092 the rest of the suite uses. When it cannot start (no Java, no Maven cache, no redis-server) every
chaos test fails with the reason — they never skip.

``RLBUS_CHAOS_SECURE=1`` runs the whole suite on a secure cluster instead (TLS, SASL_SSL + SCRAM, ACLs:
:class:`rlbus_tools.chaos.rig.ChaosRig`).

Markers (registered in pyproject.toml): every test here is ``chaos``; the ones that take longest (real worker
processes, a broker's failover) are also ``slow``, so CI can run them in a step of their own
(``-m "chaos and slow"``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from rlbus.errors import RlbusError
from rlbus_tools.chaos.rig import ChaosRig


@pytest.fixture(scope="session")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosRig]:
    try:
        secure = os.environ.get("RLBUS_CHAOS_SECURE") == "1"
        instance = ChaosRig.start(tmp_path_factory.mktemp("chaos-rig"), secure=secure)
    except RlbusError as exc:
        pytest.fail(f"the chaos rig (3 Kafka brokers + Redis) could not start: {exc}", pytrace=False)
    try:
        yield instance
    finally:
        instance.stop()
