"""A rank of the N-rank trainer SIGKILLed on the suite's Kafka and Redis (`rlbus_tools.chaos.processes`).

The run's roles are real ``rlbus worker`` processes, the trainer on two ranks under torchrun exactly as
``rlbus up`` starts it for ``[trainer] world_size = 2``. Rank 1 is killed mid-step, rank 0 (in a second
run) the moment it starts publishing a version: torchrun must stop the
whole trainer, the trainer is started again, and the exactly-once ledger must show every rollout with
one outcome, none trained twice and none lost, and the model must hold exactly the rollouts the ledger
calls trained. The scenario runs under its own namespace (topics, groups, Redis keys), so the broker on
127.0.0.1:9092 and the session's Redis are shared safely; a missing Kafka fails the test (never skips).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus_tools.chaos.processes import trainer_rank_kill
from rlbus_tools.chaos.rig import SharedServices
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("kill_rank", "at_publish"), [(1, False), (0, True)],
                         ids=["rank1-mid-step", "rank0-publishing"])
async def test_a_killed_rank_stops_the_trainer_and_a_restart_trains_nothing_twice_and_loses_nothing(
    tmp_path: Path, redis_url: str, kill_rank: int, at_publish: bool,
) -> None:
    await (await kafka_bus()).close()  # fails (not skips) with the reason when the broker is not there
    rig = SharedServices.at(tmp_path / "rig", KAFKA_BOOTSTRAP, redis_url)
    report = await trainer_rank_kill(rig, seed=0, quick=True, kill_rank=kill_rank, at_publish=at_publish)
    print(report.as_dict())
    assert report.passed, (report.checks, report.notes, report.extra)
    assert report.lost == 0 and report.duplicates_trained == 0
    assert report.trained > 0
