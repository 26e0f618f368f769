"""The fleet file (rlbus_tools.sim.fleet): defaults, validation that names the offending field, the codec's
delta-size curve and the production-traffic profile; plus the small pure helpers of report and calibrate."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from rlbus.errors import ConfigError
from rlbus_tools.sim.calibrate import relative_error
from rlbus_tools.sim.fleet import CODEC_CURVE, Fleet, TrafficSection, codec_fraction, fleet_from_dict, load_fleet
from rlbus_tools.sim.report import closed_form_staleness

REPO = Path(__file__).resolve().parents[4]

# --- defaults and loading -----------------------------------------------------------------------------


def test_empty_dict_gives_the_documented_defaults() -> None:
    fleet = fleet_from_dict({})
    assert fleet == Fleet()
    assert fleet.sim.duration_s == 6 * 3600.0 and fleet.sim.warmup_s == 0.0 and fleet.sim.sync_baseline
    assert fleet.trainer.max_staleness == 2 and fleet.trainer.slack == 0 and fleet.trainer.admission == "served"
    assert [r.name for r in fleet.region] == ["region-0"]
    assert fleet.region[0].relay is True
    assert fleet.fault == [] and fleet.autoscale.enabled is False and fleet.traffic.share == 0.0
    assert fleet.model.full_bytes == pytest.approx(8e9 * 2.0)


def test_to_dict_round_trips() -> None:
    fleet = fleet_from_dict({
        "trainer": {"max_staleness": 3, "slack": 1},
        "region": [{"name": "eu", "workers": 2}, {"name": "us", "relay": False}],
        "traffic": {"share": 0.2, "profile": [[0, 1.0], [12, 2.5]]},
        "fault": [{"kind": "region_down", "region": "eu", "at_s": 10, "for_s": 5}],
    })
    again = fleet_from_dict(fleet.to_dict())
    assert again == fleet
    assert again.traffic.profile == [(0.0, 1.0), (12.0, 2.5)]


def test_load_fleet_reads_toml_and_fills_defaults(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(
        "[sim]\nseed = 7\nduration_s = 600\n\n"
        "[trainer]\nmax_staleness = 4\n\n"
        '[[region]]\nname = "a"\nworkers = 3\n\n'
        '[[region]]\nname = "b"\nwan_gbps = 1.5\n\n'
        '[[fault]]\nkind = "region_down"\nregion = "b"\nat_s = 60\nfor_s = 30\n'
    )
    fleet = load_fleet(path)
    assert fleet.sim.seed == 7 and fleet.sim.duration_s == 600
    assert fleet.trainer.max_staleness == 4 and fleet.trainer.groups_per_step == 8
    assert [(r.name, r.workers, r.wan_gbps) for r in fleet.region] == [("a", 3, 10.0), ("b", 8, 1.5)]
    assert fleet.fault[0].region == "b" and fleet.fault[0].for_s == 30


def test_load_fleet_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        load_fleet(tmp_path / "nope.toml")
    assert missing.value.field == "fleet" and "nope.toml" in missing.value.problem
    bad = tmp_path / "bad.toml"
    bad.write_text("[sim\nseed = 1\n")
    with pytest.raises(ConfigError) as invalid:
        load_fleet(bad)
    assert invalid.value.field == "fleet" and "not valid TOML" in invalid.value.problem
    typo = tmp_path / "typo.toml"
    typo.write_text("[trainer]\nmax_stalenes = 1\n")
    with pytest.raises(ConfigError) as unknown:
        load_fleet(typo)
    assert unknown.value.field == "trainer.max_stalenes"


@pytest.mark.skipif(not (REPO / "infra/sim/composer2.toml").exists(), reason="scenario file not in this checkout")
def test_shipped_scenario_loads() -> None:
    fleet = load_fleet(REPO / "infra/sim/composer2.toml")
    assert len({r.name for r in fleet.region}) == len(fleet.region) >= 1
    assert 0 <= fleet.sim.warmup_s < fleet.sim.duration_s


# --- errors name the field ----------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "field"), [
    ({"trainer": {"lr_typo": 1.0}}, "trainer.lr_typo"),
    ({"bogus": {}}, "bogus"),
    ({"sim": {"seeed": 1}}, "sim.seeed"),
    ({"region": [{"name": "a"}, {"name": "b", "wan_gbs": 1.0}]}, "region[1].wan_gbs"),
    ({"fault": [{"kind": "preemption", "rate_per_worker_hour": 1.0, "restart": 5}]}, "fault[0].restart"),
    ({"autoscale": {"enable": True}}, "autoscale.enable"),
])
def test_unknown_field_is_named(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        fleet_from_dict(data)
    assert err.value.field == field
    assert "unknown field" in err.value.problem


def test_unknown_field_suggests_the_close_name() -> None:
    with pytest.raises(ConfigError) as err:
        fleet_from_dict({"trainer": {"max_stalenes": 1}})
    assert "max_staleness" in err.value.problem


# A wrong value is reported against the field that holds it (rlbus.config.parse names the struct field a
# check's message starts with, so each check must start with the field it checks).
@pytest.mark.parametrize(("data", "field"), [
    ({"trainer": {"max_staleness": 2, "slack": 3}}, "trainer.slack"),
    ({"trainer": {"max_staleness": 0, "slack": 1}}, "trainer.slack"),
    ({"trainer": {"max_staleness": "two"}}, "trainer.max_staleness"),
    ({"trainer": {"max_staleness": -1}}, "trainer.max_staleness"),
    ({"trainer": {"admission": "trainer"}}, "trainer.admission"),
    ({"trainer": {"group_size": 0}}, "trainer.group_size"),
    ({"trainer": {"step_cv": -0.1}}, "trainer.step_cv"),
    ({"trainer": {"publish_latency_s": -1}}, "trainer.publish_latency_s"),
    ({"region": [{"name": "a"}, {"name": "a"}]}, "region"),
    ({"region": []}, "region"),
    ({"sim": {"duration_s": 0}}, "sim.duration_s"),
    ({"sim": {"duration_s": 600, "warmup_s": 600}}, "sim.warmup_s"),
    ({"sim": {"duration_s": 600, "warmup_s": 900}}, "sim.warmup_s"),
    ({"sim": {"duration_s": 600, "warmup_s": -1}}, "sim.warmup_s"),
    ({"model": {"delta_fraction": 1.5}}, "model.delta_fraction"),
    ({"model": {"keyframe_every": 0}}, "model.keyframe_every"),
    ({"model": {"lr": 0}}, "model.lr"),
    ({"model": {"decode_bytes_per_s": 0}}, "model.decode_bytes_per_s"),
    ({"episode": {"setup_s": -1}}, "episode.setup_s"),
    ({"reward": {"judge_fraction": 1.5}}, "reward.judge_fraction"),
    ({"bus": {"join_sigma": -1}}, "bus.join_sigma"),
    ({"traffic": {"share": 1.0}}, "traffic.share"),
    ({"traffic": {"max_share": 1.0}}, "traffic.max_share"),
    ({"traffic": {"share": 0.1, "profile": [[25.0, 1.0]]}}, "traffic.profile"),
    ({"autoscale": {"max_workers": 0}}, "autoscale.max_workers"),
    ({"autoscale": {"cold_start_s": -1}}, "autoscale.cold_start_s"),
    ({"fault": [{"kind": "meteor"}]}, "fault[0].kind"),
])
def test_bad_value_names_its_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        fleet_from_dict(data)
    assert err.value.field == field
    assert field in str(err.value)


def test_bad_region_value_names_the_region_entry() -> None:
    with pytest.raises(ConfigError) as err:
        fleet_from_dict({"region": [{"name": "a"}, {"name": "b", "wan_gbps": 0}]})
    assert err.value.field == "region[1].wan_gbps"  # rlbus.config names fields inside lists of tables too


def test_fault_naming_an_unknown_region_names_the_fault() -> None:
    # the fault is wrong, not the [[region]] tables (which a bare `region` would point at)
    with pytest.raises(ConfigError) as err:
        fleet_from_dict({"region": [{"name": "a"}],
                         "fault": [{"kind": "region_down", "region": "zz", "at_s": 1, "for_s": 10}]})
    assert err.value.field.startswith("fault")
    assert "'zz'" in err.value.problem and "['a']" in err.value.problem
    # the same fault naming a listed region is fine
    fleet = fleet_from_dict({"region": [{"name": "a"}],
                             "fault": [{"kind": "region_down", "region": "a", "at_s": 1, "for_s": 10}]})
    assert fleet.fault[0].region == "a"


@pytest.mark.parametrize("fault", [
    {"kind": "region_down", "at_s": 1, "for_s": 10},  # no region
    {"kind": "region_down", "region": "a", "at_s": 1, "for_s": 0},
    {"kind": "preemption"},  # no rate
    {"kind": "preemption", "rate_per_worker_hour": 1.0, "restart_s": -1},
])
def test_incomplete_fault_is_rejected_at_its_entry(fault: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as err:
        fleet_from_dict({"region": [{"name": "a"}],
                         "fault": [{"kind": "preemption", "rate_per_worker_hour": 1}, fault]})
    assert err.value.field.startswith("fault[1]")


def test_warmup_just_inside_the_run_is_accepted() -> None:
    assert fleet_from_dict({"sim": {"duration_s": 600, "warmup_s": 599.9}}).sim.warmup_s == 599.9


def test_an_in_flight_cap_below_a_batch_is_rejected_or_trains() -> None:
    from rlbus_tools.sim.model import Simulation

    data = {"sim": {"duration_s": 300.0}, "model": {"params": 1e8},
            "trainer": {"step_s": 5.0, "groups_per_step": 4, "group_size": 4, "prompts_in_flight_cap": 2},
            "episode": {"tokens_median": 500.0},
            "region": [{"name": "a", "workers": 3, "tokens_per_s": 2000.0, "concurrency": 16,
                        "groups_in_flight": 2}]}
    try:
        fleet = fleet_from_dict(data)
    except ConfigError as err:
        assert err.field == "trainer.prompts_in_flight_cap"
        return
    assert Simulation(fleet).run()["summary"]["steps"] > 0


# --- the codec's delta-size curve ---------------------------------------------------------------------

_POINTS = [(lr, step, pct) for lr, curve in CODEC_CURVE.items() for step, pct in curve.items()]


@pytest.mark.parametrize(("lr", "step", "pct"), _POINTS)
def test_codec_fraction_is_the_measurement_at_measured_points(lr: float, step: int, pct: float) -> None:
    assert codec_fraction(lr, step) == pytest.approx(pct / 100.0, rel=1e-12)


def test_codec_fraction_interpolates_log_log() -> None:
    # halfway in log(lr) between 1e-6 and 3e-6 at a measured step: the geometric mean of the two sizes
    lr = math.sqrt(1e-6 * 3e-6)
    assert codec_fraction(lr, 1) == pytest.approx(math.sqrt(0.79 * 1.61) / 100, rel=1e-12)
    assert codec_fraction(lr, 10) == pytest.approx(math.sqrt(0.29 * 0.66) / 100, rel=1e-12)
    # a straight line in (log step, log size) between the measured steps 1 and 5 at a measured lr
    w = math.log(2) / math.log(5)
    assert codec_fraction(3e-6, 2) == pytest.approx(1.61 ** (1 - w) * 0.84**w / 100, rel=1e-12)
    w = (math.log(7) - math.log(5)) / (math.log(10) - math.log(5))
    assert codec_fraction(1e-5, 7) == pytest.approx(1.96 ** (1 - w) * 1.56**w / 100, rel=1e-12)


@pytest.mark.parametrize("lr", [1e-6, 2e-6, 3e-6, 5e-6, 1e-5])
def test_codec_fraction_decreases_with_step_then_holds(lr: float) -> None:
    sizes = [codec_fraction(lr, step) for step in range(1, 11)]
    assert all(a > b for a, b in itertools.pairwise(sizes)), sizes
    # past the last measured step the size holds (Adam's update scale has settled)
    assert codec_fraction(lr, 50) == pytest.approx(sizes[-1], rel=1e-12)
    assert codec_fraction(lr, 10_000) == pytest.approx(sizes[-1], rel=1e-12)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 10, 40])
def test_codec_fraction_increases_with_lr_then_clamps(step: int) -> None:
    lrs = [10 ** (-6 + i / 20) for i in range(21)]  # 1e-6 … 1e-5, log-spaced
    sizes = [codec_fraction(lr, step) for lr in lrs]
    assert all(a < b for a, b in itertools.pairwise(sizes)), sizes
    assert codec_fraction(1e-8, step) == pytest.approx(sizes[0], rel=1e-12)
    assert codec_fraction(1e-3, step) == pytest.approx(sizes[-1], rel=1e-12)


def test_delta_fraction_follows_the_curve_or_the_override() -> None:
    fleet = fleet_from_dict({"model": {"lr": 1e-5}, "trainer": {"publish_every": 5}})
    # version 2 is the first delta: one publish interval = 5 optimizer steps after the keyframe
    assert fleet.delta_fraction(2) == pytest.approx(CODEC_CURVE[1e-5][5] / 100)
    assert fleet.delta_fraction(3) == pytest.approx(CODEC_CURVE[1e-5][10] / 100)
    assert fleet.delta_fraction(1) == pytest.approx(CODEC_CURVE[1e-5][5] / 100)
    fixed = fleet_from_dict({"model": {"lr": 1e-5, "delta_fraction": 0.02}})
    assert fixed.delta_fraction(2) == fixed.delta_fraction(30) == 0.02


# --- production traffic -------------------------------------------------------------------------------

H = 3600.0


def test_no_share_means_no_traffic_whatever_the_profile() -> None:
    traffic = TrafficSection(share=0.0, profile=[(0.0, 5.0), (12.0, 10.0)])
    assert [traffic.share_at(t * H) for t in (0, 6, 12, 23)] == [0.0, 0.0, 0.0, 0.0]


def test_share_at_interpolates_the_daily_profile() -> None:
    traffic = TrafficSection(share=0.2, profile=[(0.0, 1.0), (6.0, 3.0)])
    assert traffic.share_at(0) == pytest.approx(0.2)
    assert traffic.share_at(3 * H) == pytest.approx(0.4)  # halfway 1 → 3
    assert traffic.share_at(6 * H) == pytest.approx(0.6)
    assert traffic.share_at(1.5 * H) == pytest.approx(0.2 * 1.5)
    # from 06:00 the profile returns to its 00:00 point, reached again at 24:00 (wrap-around)
    assert traffic.share_at(15 * H) == pytest.approx(0.4)  # halfway 3 → 1 over 06:00 … 24:00
    assert traffic.share_at(21 * H) == pytest.approx(0.2 * (3 - 2 * 15 / 18))
    # repeated every day
    for hour in (0.5, 3.0, 7.25, 15.0, 23.9):
        assert traffic.share_at((hour + 24) * H) == pytest.approx(traffic.share_at(hour * H))
        assert traffic.share_at((hour + 72) * H) == pytest.approx(traffic.share_at(hour * H))


def test_share_at_wraps_before_the_first_point() -> None:
    traffic = TrafficSection(share=0.1, profile=[(6.0, 2.0), (18.0, 4.0)])
    # 18:00 → 30:00 (= 06:00 next day) goes 4 → 2: midnight is halfway
    assert traffic.share_at(0) == pytest.approx(0.3)
    assert traffic.share_at(3 * H) == pytest.approx(0.1 * 2.5)
    assert traffic.share_at(12 * H) == pytest.approx(0.3)


def test_share_at_ignores_the_profile_order() -> None:
    ordered = TrafficSection(share=0.1, profile=[(0.0, 1.0), (8.0, 2.0), (16.0, 0.5)])
    shuffled = TrafficSection(share=0.1, profile=[(16.0, 0.5), (0.0, 1.0), (8.0, 2.0)])
    for hour in range(0, 24, 2):
        assert shuffled.share_at(hour * H) == pytest.approx(ordered.share_at(hour * H))


def test_share_at_is_capped_at_max_share() -> None:
    traffic = TrafficSection(share=0.5, profile=[(0.0, 1.0), (12.0, 3.0)])
    assert traffic.share_at(0) == pytest.approx(0.5)
    assert traffic.share_at(12 * H) == pytest.approx(0.9)  # 1.5 capped at the default 0.9
    assert max(traffic.share_at(t * H / 4) for t in range(96)) == pytest.approx(0.9)
    tight = TrafficSection(share=0.5, profile=[(0.0, 1.0), (12.0, 3.0)], max_share=0.6)
    assert tight.share_at(6 * H) == pytest.approx(0.6)  # 0.5 × 2 = 1.0 → 0.6
    assert tight.share_at(1 * H) == pytest.approx(0.5 * (1 + 2 / 12))  # 0.583…, under the cap
    assert all(tight.share_at(t * H / 4) <= 0.6 + 1e-12 for t in range(96))


def test_single_point_profile_is_constant() -> None:
    traffic = TrafficSection(share=0.3, profile=[(9.0, 1.5)])
    assert {round(traffic.share_at(t * H), 12) for t in range(24)} == {0.45}


# --- small helpers ------------------------------------------------------------------------------------


def test_closed_form_staleness_is_littles_law() -> None:
    # L / B + lag / T
    assert closed_form_staleness(12.0, 4, 3.0, 20.0) == pytest.approx(3.0 + 0.15)
    assert closed_form_staleness(0.0, 8, 0.0, 5.0) == 0.0


def test_relative_error() -> None:
    assert relative_error(110.0, 100.0, 1.0) == pytest.approx(0.1)
    assert relative_error(90.0, 100.0, 1.0) == pytest.approx(0.1)
    assert relative_error(-2.0, -4.0, 0.0) == pytest.approx(0.5)
    # below its floor the measurement counts as the floor: 0 measured, 0.01 predicted, floor 0.05 → 20 %
    assert relative_error(0.01, 0.0, 0.05) == pytest.approx(0.2)
    assert relative_error(None, 3.0, 1.0) == 1.0
    assert relative_error(3.0, 3.0, 1.0) == 0.0
