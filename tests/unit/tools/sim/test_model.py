"""The discrete-event model (rlbus_tools.sim.model) on small fleets: a few workers, minutes to half an hour of
simulated time, each run well under a second.

The base fleet is balanced: 3 workers × 2 groups in flight, a group of 4 episodes (~500 tokens at 125
tokens/s per sequence) takes ~8 s, the trainer steps 4 groups in 5 s. A 100 M-parameter model keeps the
first keyframe small (135 MB) so slow links are cheap to simulate.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from rlbus_tools.sim.fleet import Fleet, codec_fraction, fleet_from_dict
from rlbus_tools.sim.model import Simulation
from rlbus_tools.sim.report import closed_form_staleness

BASE: dict[str, Any] = {
    "sim": {"duration_s": 1800.0, "seed": 1, "sync_baseline": False},
    "model": {"params": 1e8},
    "trainer": {"step_s": 5.0, "groups_per_step": 4, "group_size": 4, "max_staleness": 2},
    "episode": {"tokens_median": 500.0, "tokens_sigma": 0.5},
    "bus": {"session_timeout_s": 20.0},
    "region": [{"name": "a", "workers": 3, "tokens_per_s": 2000.0, "concurrency": 16, "groups_in_flight": 2}],
}
REGION: dict[str, Any] = BASE["region"][0]


def data(**sections: Any) -> dict[str, Any]:
    """BASE with tables updated (dicts) or replaced (lists: region, fault)."""
    result = copy.deepcopy(BASE)
    for name, value in sections.items():
        if isinstance(value, dict):
            result.setdefault(name, {}).update(value)
        else:
            result[name] = copy.deepcopy(value)
    return result


def region(**fields: Any) -> dict[str, Any]:
    return {**REGION, **fields}


_RUNS: dict[str, tuple[Simulation, dict[str, Any]]] = {}


def simulate(fleet_data: dict[str, Any], mode: str = "async") -> tuple[Simulation, dict[str, Any]]:
    """One run per (fleet, mode) for the whole module: tests only read the result."""
    key = json.dumps([fleet_data, mode], sort_keys=True)
    if key not in _RUNS:
        sim = Simulation(fleet_from_dict(fleet_data), mode)  # type: ignore[arg-type]
        _RUNS[key] = sim, sim.run()
    return _RUNS[key]


def trained_rollouts(result: dict[str, Any]) -> float:
    start, end = result["window_s"]
    return result["summary"]["trained_rollouts_per_min"] * (end - start) / 60


def steps_between(sim: Simulation, start: float, end: float) -> int:
    return sum(1 for s in sim.stats.steps if start <= s["t"] < end and s["rollouts"])


# --- the result ---------------------------------------------------------------------------------------

SUMMARY_KEYS = {
    "trained_rollouts_per_min", "trained_tokens_per_s", "steps", "versions", "version_interval_s",
    "staleness_mean_versions", "stale_drop_fraction", "sync_lag_mean_s", "publish_to_all_swapped_s_p50",
    "publish_to_all_swapped_s_p99", "delta_transfer_s_by_region", "full_snapshot_transfer_s_by_region",
    "wan_bytes_per_version_by_region", "in_system_groups_mean", "utilisation", "dropped_rollouts",
    "wasted_generation_slot_s", "lost_groups",
}


def test_a_run_covers_its_duration_and_reports_every_figure() -> None:
    sim, result = simulate(data(sim={"warmup_s": 300.0}))
    assert result["mode"] == "async"
    assert sim.env.now == 1800.0
    start, end = result["window_s"]
    assert 300.0 <= start < 400.0 and end == 1800.0  # counting from the first step after warmup
    summary = result["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert summary["steps"] > 100 and summary["versions"] >= summary["steps"] - 1
    assert summary["trained_tokens_per_s"] > 0
    assert set(summary["wan_bytes_per_version_by_region"]) == {"a"}
    assert 0 < summary["utilisation"]["trainer"] <= 1 and 0 < summary["utilisation"]["rollout_slots"] <= 1
    # every trained rollout is in the staleness histogram once
    assert sum(result["staleness_histogram"].values()) == pytest.approx(trained_rollouts(result), abs=1)


# --- staleness ----------------------------------------------------------------------------------------

STALENESS_CASES = {
    "served": data(),
    "max-staleness-0": data(trainer={"max_staleness": 0}),
    "publish-every-2": data(trainer={"max_staleness": 3, "publish_every": 2}),
    "served-slack-slow-wan": data(trainer={"max_staleness": 2, "slack": 1}, region=[region(wan_gbps=0.005)]),
    "published-slow-relay": data(trainer={"max_staleness": 1, "admission": "published"},
                                 region=[region(wan_gbps=0.005)]),
    "published-slow-no-relay": data(trainer={"max_staleness": 2, "admission": "published"},
                                    region=[region(wan_gbps=0.02, relay=False)]),
    "published-0": data(trainer={"max_staleness": 0, "admission": "published"}, region=[region(wan_gbps=0.02)]),
}


@pytest.mark.parametrize("case", list(STALENESS_CASES))
def test_async_staleness_never_exceeds_max_staleness(case: str) -> None:
    fleet_data = STALENESS_CASES[case]
    _, result = simulate(fleet_data)
    limit = fleet_data["trainer"]["max_staleness"]
    histogram = {int(k): v for k, v in result["staleness_histogram"].items()}
    assert histogram, "nothing trained"
    assert max(histogram) <= limit, histogram
    assert min(histogram) >= 0
    summary = result["summary"]
    assert summary["staleness_mean_versions"] <= limit
    assert summary["lost_groups"] == 0
    stale = summary["dropped_rollouts"]["stale"]
    trained = trained_rollouts(result)
    assert summary["stale_drop_fraction"] == pytest.approx(stale / (stale + trained), abs=1e-3)


@pytest.mark.parametrize("case", ["published-slow-relay", "published-slow-no-relay", "published-0"])
def test_published_admission_with_slow_syncs_drops_stale_rollouts(case: str) -> None:
    """Counting from the trainer's version lets workers start prompts on weights the trainer's check then
    rejects: drops happen, and the bound still holds for what is trained."""
    _, result = simulate(STALENESS_CASES[case])
    summary = result["summary"]
    assert summary["stale_drop_fraction"] > 0.05
    assert summary["dropped_rollouts"]["stale"] > 0
    assert summary["dropped_rollouts"]["stale"] % BASE["trainer"]["group_size"] == 0  # whole groups


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("link", [{"wan_gbps": 0.005}, {"wan_gbps": 0.02, "relay": False}])
def test_served_admission_drops_nothing_even_with_slow_syncs(seed: int, max_staleness: int, link: dict[str, Any]
                                                              ) -> None:
    """Counting from the version the workers serve bounds what they start on: no rollout is dropped."""
    fleet_data = data(sim={"seed": seed, "duration_s": 900.0}, trainer={"max_staleness": max_staleness},
                      region=[region(**link)])
    _, result = simulate(fleet_data)
    summary = result["summary"]
    assert summary["sync_lag_mean_s"] > 1.0  # slow syncs indeed
    assert summary["stale_drop_fraction"] == 0.0
    assert summary["dropped_rollouts"]["stale"] == 0
    assert max(int(k) for k in result["staleness_histogram"]) <= max_staleness
    # and the published-counting variant of the same fleet does drop
    published = copy.deepcopy(fleet_data)
    published["trainer"]["admission"] = "published"
    assert simulate(published)[1]["summary"]["stale_drop_fraction"] > 0


def test_staleness_bound_is_used_when_the_trainer_waits() -> None:
    """A trainer-bound fleet fills the admission window: groups wait ~max_staleness versions."""
    _, result = simulate(CLOSED_FORM_CASES["gps4-ms3"])
    histogram = {int(k): v for k, v in result["staleness_histogram"].items()}
    assert max(histogram, key=lambda k: histogram[k]) == 3


# --- sync vs async ------------------------------------------------------------------------------------

GENERATION_HEAVY = data(trainer={"step_s": 2.0}, episode={"tokens_sigma": 1.0}, sim={"duration_s": 1200.0})


def test_sync_mode_trains_only_fresh_rollouts() -> None:
    _, result = simulate(GENERATION_HEAVY, "sync")
    assert result["mode"] == "sync"
    assert set(result["staleness_histogram"]) == {"0"}
    assert result["summary"]["staleness_mean_versions"] == 0.0
    assert result["summary"]["stale_drop_fraction"] == 0.0
    assert result["summary"]["steps"] > 20


def test_async_beats_sync_on_a_generation_heavy_fleet() -> None:
    _, async_result = simulate(GENERATION_HEAVY)
    _, sync_result = simulate(GENERATION_HEAVY, "sync")
    async_rate = async_result["summary"]["trained_tokens_per_s"]
    sync_rate = sync_result["summary"]["trained_tokens_per_s"]
    assert async_rate > 1.3 * sync_rate, (async_rate, sync_rate)
    # sync leaves the rollout fleet idle while it waits for each batch's slowest group
    assert (sync_result["summary"]["utilisation"]["rollout_slots"]
            < async_result["summary"]["utilisation"]["rollout_slots"])


def test_scenarios_report_the_async_vs_sync_speedup() -> None:
    from rlbus_tools.sim.scenarios import run_scenarios

    fleet_data = copy.deepcopy(GENERATION_HEAVY)
    fleet_data["sim"]["sync_baseline"] = True
    out = run_scenarios(fleet_from_dict(fleet_data))
    speedup = out["summary"]["async_vs_sync_speedup"]
    assert speedup is not None and speedup > 1.3
    runs = out["scenarios"]
    assert set(runs) == {"async", "sync"}
    expected = runs["async"]["summary"]["trained_tokens_per_s"] / runs["sync"]["summary"]["trained_tokens_per_s"]
    assert speedup == pytest.approx(expected, abs=1e-3)


# --- determinism --------------------------------------------------------------------------------------


def test_a_seed_reproduces_its_run_and_another_seed_differs() -> None:
    fleet_data = data(sim={"duration_s": 600.0}, episode={"tokens_sigma": 1.0})
    first = Simulation(fleet_from_dict(fleet_data)).run()
    second = Simulation(fleet_from_dict(fleet_data)).run()
    assert first == second
    other = copy.deepcopy(fleet_data)
    other["sim"]["seed"] = 2
    third = Simulation(fleet_from_dict(other)).run()
    assert third["summary"] != first["summary"]
    assert third["summary"]["trained_tokens_per_s"] != first["summary"]["trained_tokens_per_s"]


# --- weights over the WAN -----------------------------------------------------------------------------

DELTA = 0.01
RELAY_FLEET = data(
    sim={"duration_s": 900.0},
    model={"delta_fraction": DELTA},
    region=[region(name="relayed", workers=4, wan_gbps=1.0, relay=True),
            region(name="direct", workers=4, wan_gbps=1.0, relay=False)],
)


def test_a_relay_moves_each_delta_across_the_wan_once() -> None:
    sim, result = simulate(RELAY_FLEET)
    delta_bytes = sim.fleet.model.full_bytes * DELTA
    wan = result["summary"]["wan_bytes_per_version_by_region"]
    assert wan["relayed"] == pytest.approx(delta_bytes, rel=0.02)
    # without a relay every worker pulls every delta itself
    assert wan["direct"] == pytest.approx(4 * delta_bytes, rel=0.02)
    # …over the same link, shared: each worker's pull takes longer than the relay's
    transfer = result["summary"]["delta_transfer_s_by_region"]
    assert transfer["direct"] > transfer["relayed"] > 0


def test_wan_bytes_scale_with_the_workers_without_a_relay() -> None:
    two = data(sim={"duration_s": 600.0}, model={"delta_fraction": DELTA},
               region=[region(name="direct", workers=2, wan_gbps=1.0, relay=False)])
    six = data(sim={"duration_s": 600.0}, model={"delta_fraction": DELTA},
               region=[region(name="direct", workers=6, wan_gbps=1.0, relay=False)])
    sim, two_result = simulate(two)
    _, six_result = simulate(six)
    delta_bytes = sim.fleet.model.full_bytes * DELTA
    assert two_result["summary"]["wan_bytes_per_version_by_region"]["direct"] == pytest.approx(2 * delta_bytes,
                                                                                                rel=0.02)
    assert six_result["summary"]["wan_bytes_per_version_by_region"]["direct"] == pytest.approx(6 * delta_bytes,
                                                                                                rel=0.02)


def test_published_delta_sizes_follow_the_codec_curve() -> None:
    sim, _ = simulate(data(sim={"duration_s": 300.0}, model={"lr": 1e-5}, trainer={"publish_every": 2}))
    full = sim.fleet.model.full_bytes
    sizes = sim.stats.version_bytes
    assert sizes[1] == pytest.approx(full * sim.fleet.model.keyframe_fraction)
    assert len(sizes) > 10
    for version in range(2, len(sizes) + 1):
        assert sizes[version] == pytest.approx(full * codec_fraction(1e-5, (version - 1) * 2)), version


# --- faults -------------------------------------------------------------------------------------------

CUT_AT, CUT_FOR = 600.0, 300.0


def _region_down(relay: bool) -> dict[str, Any]:
    return data(region=[region(name="a", workers=2), region(name="b", workers=2, relay=relay)],
                fault=[{"kind": "region_down", "region": "b", "at_s": CUT_AT, "for_s": CUT_FOR}])


REGION_DOWN = _region_down(relay=True)
REGION_DOWN_CASES = {"relay": REGION_DOWN, "no-relay": _region_down(relay=False)}
PREEMPTION = data(
    region=[region(workers=4)],
    fault=[{"kind": "preemption", "rate_per_worker_hour": 6.0, "restart_s": 60.0}],
)


@pytest.mark.parametrize("case", list(REGION_DOWN_CASES))
def test_a_region_cut_redelivers_its_groups_and_the_run_goes_on(case: str) -> None:
    sim, result = simulate(REGION_DOWN_CASES[case])
    summary = result["summary"]
    assert sim.env.now == 1800.0
    redelivered = summary["dropped_rollouts"]["redelivered_after_loss"]
    assert redelivered > 0 and redelivered % BASE["trainer"]["group_size"] == 0
    assert summary["wasted_generation_slot_s"] > 0
    assert summary["lost_groups"] == 0
    # a lost group would stall the ordered join, and the trainer with it: it trains on to the end
    assert steps_between(sim, CUT_AT, CUT_AT + CUT_FOR) > 10  # region a carries on alone
    assert steps_between(sim, 1500.0, 1800.0) > 20
    assert max(int(k) for k in result["staleness_histogram"]) <= BASE["trainer"]["max_staleness"]


@pytest.mark.parametrize("case", list(REGION_DOWN_CASES))
def test_a_cut_region_swaps_nothing_until_it_is_back_then_catches_up(case: str) -> None:
    sim, result = simulate(REGION_DOWN_CASES[case])
    cut_end = CUT_AT + CUT_FOR
    swaps = sim.stats.swaps
    b_workers = [name for name, r in sim.stats.worker_region.items() if r == "b"]
    a_workers = [name for name, r in sim.stats.worker_region.items() if r == "a"]
    assert len(b_workers) == 2 and len(a_workers) == 2
    # a swap already staged may finish within its pause after the cut; nothing more until the cut ends
    margin = sim.fleet.model.swap_pause_s + 0.5
    for name in b_workers:
        assert not [t for t in swaps[name].values() if CUT_AT + margin < t < cut_end], name
        # afterwards the worker serves versions published after the cut ended
        assert any(t > cut_end and sim.stats.publishes[v] > cut_end for v, t in swaps[name].items()), name
    for name in a_workers:  # the other region keeps swapping through the cut
        assert [t for t in swaps[name].values() if CUT_AT < t < cut_end]
    published = sim.stats.publishes
    during = [v for v, t in published.items() if CUT_AT + margin < t < cut_end]
    after = [v for v, t in published.items() if t > cut_end + 10]
    assert during and after
    lag = {v: s for v, s in result["swap_times"]["b"]}
    # versions published during the cut reached region b only once it was back…
    for v in during:
        assert v in lag and published[v] + lag[v] >= cut_end
    # …and the versions after it reach b as quickly as they reach a
    assert all(v in lag for v in after[:-3])
    late = [lag[v] for v in after[:-3]]
    assert max(late) < 30.0


def test_preemptions_redeliver_and_lose_nothing() -> None:
    sim, result = simulate(PREEMPTION)
    summary = result["summary"]
    assert summary["dropped_rollouts"]["redelivered_after_loss"] > 0
    assert summary["wasted_generation_slot_s"] > 0
    assert summary["lost_groups"] == 0
    assert steps_between(sim, 1500.0, 1800.0) > 20
    assert max(int(k) for k in result["staleness_histogram"]) <= BASE["trainer"]["max_staleness"]
    # a preempted worker comes back and takes work again: all four serve a recent version at the end
    newest = sim.version
    assert sum(1 for w in sim.workers if w.alive and w.version >= newest - 5) >= 3


LOST_GROUP_CASES = {
    "base": data(),
    # trainer-bound: 20 s steps, the run ends while the trainer is stepping on 4 groups
    "trainer-bound": data(sim={"duration_s": 610.0}, trainer={"step_s": 20.0, "step_cv": 0.0},
                          region=[region(workers=8, tokens_per_s=20000.0)]),
    "region-down": REGION_DOWN,
    "preemption": PREEMPTION,
}


def test_no_group_is_ever_lost() -> None:
    # lost_groups = admitted − taken by the trainer − in the system: 0 also when the run ends mid-step
    lost = {name: simulate(fleet_data)[1]["summary"]["lost_groups"] for name, fleet_data in LOST_GROUP_CASES.items()}
    assert lost == {name: 0 for name in LOST_GROUP_CASES}


def _run_losing_one_group() -> tuple[Simulation, dict[str, Any]]:
    """The base fleet with one admitted prompt taken out of the prompt queue at t ≥ 300 s: a lost group."""
    sim = Simulation(fleet_from_dict(data(sim={"duration_s": 600.0})))

    def thief() -> Any:
        yield sim.env.timeout(300.0)
        while not sim.queue.items:
            yield sim.env.timeout(1.0)
        sim.queue.items.popleft()

    sim.env.process(thief())
    return sim, sim.run()


def test_a_lost_group_stalls_the_ordered_join() -> None:
    # why the fault tests check that the trainer keeps stepping to the end: a lost group stops it for good
    sim, _ = _run_losing_one_group()
    assert steps_between(sim, 0.0, 300.0) > 20
    assert steps_between(sim, 340.0, 600.0) == 0


def test_lost_groups_counts_a_lost_group() -> None:
    _, result = _run_losing_one_group()
    assert result["summary"]["lost_groups"] == 1


# --- autoscaling and traffic --------------------------------------------------------------------------

AUTOSCALE = data(
    sim={"duration_s": 900.0},
    trainer={"step_s": 1.0, "max_staleness": 4},
    region=[region(workers=1)],
    autoscale={"enabled": True, "lag_per_worker": 2.0, "min_workers": 1, "max_workers": 6, "poll_s": 15.0,
               "cold_start_s": 30.0},
)


def test_autoscaling_grows_a_small_fleet_under_lag() -> None:
    _, scaled = simulate(AUTOSCALE)
    sizes = [n for _, n in scaled["fleet_size"]]
    assert max(sizes) > 1
    assert max(sizes) <= 6
    # it grows after a poll and a cold start, not before
    early = [n for t, n in scaled["fleet_size"] if t < 15.0 + 30.0]
    assert max(early) <= 1
    fixed = copy.deepcopy(AUTOSCALE)
    fixed["autoscale"]["enabled"] = False
    _, unscaled = simulate(fixed)
    assert {n for t, n in unscaled["fleet_size"] if t > 10} == {1}
    assert (scaled["summary"]["trained_tokens_per_s"]
            > 1.5 * unscaled["summary"]["trained_tokens_per_s"])


def test_production_traffic_slows_a_generation_bound_fleet() -> None:
    bound = data(sim={"duration_s": 900.0}, trainer={"step_s": 0.5})
    shared = copy.deepcopy(bound)
    shared["traffic"] = {"share": 0.5}
    _, alone = simulate(bound)
    _, half = simulate(shared)
    assert alone["summary"]["utilisation"]["trainer"] < 0.5  # generation-bound indeed
    ratio = half["summary"]["trained_tokens_per_s"] / alone["summary"]["trained_tokens_per_s"]
    # half of every worker's decode rate goes to production: about half the throughput
    assert 0.35 < ratio < 0.7, ratio


# --- the closed form ----------------------------------------------------------------------------------

def _trainer_bound(groups_per_step: int, max_staleness: int) -> dict[str, Any]:
    return data(trainer={"step_s": 20.0, "step_cv": 0.05, "groups_per_step": groups_per_step,
                         "max_staleness": max_staleness},
                region=[region(workers=8, tokens_per_s=20000.0)])


CLOSED_FORM_CASES = {
    "gps4-ms3": _trainer_bound(4, 3),
    "gps8-ms2": _trainer_bound(8, 2),
    "gps4-ms1": _trainer_bound(4, 1),
}


@pytest.mark.parametrize("case", list(CLOSED_FORM_CASES))
def test_closed_form_staleness_matches_a_trainer_bound_run(case: str) -> None:
    fleet_data = CLOSED_FORM_CASES[case]
    _, result = simulate(fleet_data)
    summary = result["summary"]
    assert summary["utilisation"]["trainer"] > 0.95  # trainer-bound
    t = fleet_data["trainer"]
    groups_per_version = t["groups_per_step"] * t.get("publish_every", 1)
    predicted = closed_form_staleness(summary["in_system_groups_mean"], groups_per_version,
                                      summary["sync_lag_mean_s"], summary["version_interval_s"])
    measured = summary["staleness_mean_versions"]
    assert measured > 0.5
    assert predicted == pytest.approx(measured, rel=0.15)


def test_fleet_helper_builds_valid_fleets() -> None:
    # the module's fleets are valid as written (a typo would make every test above test the defaults)
    for fleet_data in [*STALENESS_CASES.values(), *LOST_GROUP_CASES.values(), *CLOSED_FORM_CASES.values(),
                       AUTOSCALE, RELAY_FLEET, GENERATION_HEAVY]:
        assert isinstance(fleet_from_dict(fleet_data), Fleet)
