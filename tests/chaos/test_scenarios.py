"""Every chaos scenario end to end on the rig, with a fixed seed: the same functions `rlbus bench chaos` runs.

Each asserts the scenario's own checks (``report.checks``: faults fired, workers kept running, recovery
happened, the scenario-specific evidence) and the ledger: nothing lost, nothing trained twice, no
corrupt weights served. A failing scenario's report (faults, checks, notes) is the assertion message.
"""

from __future__ import annotations

import json

import pytest

from rlbus_tools.chaos import scenarios
from rlbus_tools.chaos.ledger import ScenarioReport
from rlbus_tools.chaos.rig import ChaosRig

pytestmark = [pytest.mark.chaos, pytest.mark.kafka, pytest.mark.redis]


def verdict(report: ScenarioReport) -> None:
    text = json.dumps(report.as_dict(), indent=1, default=str)
    assert report.checks, text
    assert all(report.checks.values()), text
    assert (report.lost, report.duplicates_trained, report.corrupt_applied) == (0, 0, 0), text
    assert report.produced > 0 and report.trained > 0, text
    assert report.passed, text


async def test_poison_is_dead_lettered_with_reasons(rig: ChaosRig) -> None:
    report = await scenarios()["poison"](rig, seed=0, quick=True)
    verdict(report)
    assert report.dead_lettered == 3  # the trainer's three rollout-topic letters, once each
    assert report.extra["dead_letters"] == 11
    assert "MessageSizeTooLarge" in report.extra["oversize_produce_error"]


async def test_corrupt_chunks_are_never_served(rig: ChaosRig) -> None:
    report = await scenarios()["corrupt_chunk"](rig, seed=0, quick=True)
    verdict(report)
    assert report.extra["swaps_checked"] > 10
    assert report.extra["rollouts_on_v3_meanwhile"] > 0


async def test_blob_store_outage_is_ridden_out(rig: ChaosRig) -> None:
    report = await scenarios()["blob_store_down"](rig, seed=0, quick=True)
    verdict(report)
    assert report.extra["max_versions_behind"] >= 1 and report.recovery_s is not None


async def test_redis_restart_keeps_the_join_and_the_ledger(rig: ChaosRig) -> None:
    report = await scenarios()["redis_restart"](rig, seed=0, quick=True)
    verdict(report)
    assert report.recovery_s is not None


@pytest.mark.slow
async def test_a_broker_dies_under_load(rig: ChaosRig) -> None:
    report = await scenarios()["broker_kill"](rig, seed=0, quick=True)
    verdict(report)
    assert report.extra["outcomes_while_down"] > 0


@pytest.mark.slow
async def test_a_rollout_worker_process_is_killed(rig: ChaosRig) -> None:
    verdict(await scenarios()["rollout_kill"](rig, seed=0, quick=True))


@pytest.mark.slow
@pytest.mark.timeout(480)  # ends with a graceful stop and a final checkpoint; ~275 s seen on a loaded machine
async def test_the_trainer_process_is_killed_and_restarted(rig: ChaosRig) -> None:
    report = await scenarios()["trainer_kill"](rig, seed=0, quick=True)
    verdict(report)
    assert report.extra["rollouts_in_model"] == report.extra["rollouts_trained_in_ledger"] > 0


@pytest.mark.slow
async def test_a_worker_whose_weights_lag_past_the_bound_does_not_stall_the_run(rig: ChaosRig) -> None:
    report = await scenarios()["worker_lag"](rig, seed=0, quick=True)
    verdict(report)
    assert report.extra["dropped_stale"] > 0 and report.extra["groups_freed"] > 0
    assert report.extra["thawed_at_version"] > report.extra["frozen_at_version"] + 1


@pytest.mark.slow
async def test_sigterm_drains_and_a_second_exits_at_once(rig: ChaosRig) -> None:
    report = await scenarios()["graceful_stop"](rig, seed=0, quick=True)
    verdict(report)
    assert report.extra["second_sigterm_exit_s"] < 5
