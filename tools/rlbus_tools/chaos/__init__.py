"""Chaos scenarios: real brokers, Redis, blob stores and workers broken on purpose, then the ledger checked.

Each scenario is an ``async def (rig, *, seed, quick) -> ScenarioReport`` (:mod:`rlbus_tools.chaos.ledger`)
that runs the RL loop on the private infrastructure of a :class:`~rlbus_tools.chaos.rig.ChaosRig`, injects
its fault with a fixed seed, waits until every rollout has an outcome and audits the exactly-once
ledger. ``rlbus bench chaos`` and the pytest suite under ``tests/chaos/`` run the same functions.

    broker_kill       one of three Kafka brokers SIGKILLed under load, restarted   (rlbus_tools.chaos.infra)
    redis_restart     Redis SIGKILLed and restarted on its append-only file         (rlbus_tools.chaos.infra)
    corrupt_chunk     delta chunks damaged at rest and in flight                    (rlbus_tools.chaos.blobs)
    blob_store_down   the HTTP blob server down for a while                         (rlbus_tools.chaos.blobs)
    poison            garbage, wrong schema versions, oversize, NaN rewards         (rlbus_tools.chaos.poison)
    rollout_kill      a `rlbus worker rollout` process SIGKILLed mid-generation      (rlbus_tools.chaos.processes)
    trainer_kill      the trainer process SIGKILLed mid-step and restarted          (rlbus_tools.chaos.processes)
    worker_lag        a rollout worker's weights frozen past max_staleness, thawed  (rlbus_tools.chaos.processes)
    graceful_stop     SIGTERM drains and commits; a second SIGTERM exits at once    (rlbus_tools.chaos.processes)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rlbus_tools.chaos.ledger import ScenarioReport
from rlbus_tools.chaos.rig import ChaosRig

Scenario = Callable[..., Awaitable[ScenarioReport]]


def scenarios() -> dict[str, Scenario]:
    """Every scenario by name, in the order the bench runs them (imports torch: call it lazily)."""
    from rlbus_tools.chaos.blobs import blob_store_down, corrupt_chunk
    from rlbus_tools.chaos.infra import broker_kill, redis_restart
    from rlbus_tools.chaos.poison import poison
    from rlbus_tools.chaos.processes import graceful_stop, rollout_kill, trainer_kill, worker_lag

    return {
        "poison": poison,
        "corrupt_chunk": corrupt_chunk,
        "blob_store_down": blob_store_down,
        "redis_restart": redis_restart,
        "broker_kill": broker_kill,
        "rollout_kill": rollout_kill,
        "trainer_kill": trainer_kill,
        "worker_lag": worker_lag,
        "graceful_stop": graceful_stop,
    }


__all__ = ["ChaosRig", "Scenario", "ScenarioReport", "scenarios"]
