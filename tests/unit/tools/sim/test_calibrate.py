"""Calibration reads a run log into parameters and figures; a run config's settings lay over a fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlbus.errors import RunLogMissing
from rlbus.launch.config import load_config
from rlbus_tools.sim.calibrate import FIGURES, measure, relative_error, with_run_config
from rlbus_tools.sim.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[4]


def write(run: Path, name: str, lines: list[dict[str, Any]]) -> None:
    (run / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def synthetic_run(run: Path, *, steps: int = 6, stale_per_step: int = 2) -> None:
    """A run log with exact timings: a step every 1.0 s (0.3 s step, 0.1 s publish), two groups of G=2 per
    step, each trained at staleness 1, version v's manifest at step v−1's end."""
    run.mkdir()
    t0, g = 1000.0, 2
    step_lines, inputs, rollouts, prompts, syncs, weights, completions = [], [], [], [], [], [], []
    for k in range(1, steps + 1):
        end = t0 + k
        step_lines.append({"t": end, "step": k, "version": k + 1, "step_s": 0.3, "publish_s": 0.1, "published": True,
                           "rollouts": 2 * g, "staleness": {"1": 2 * g}, "dropped_stale": stale_per_step})
        weights.append({"t": end, "version": k + 1, "kind": "delta", "full_bytes": 1000, "delta_bytes": 10,
                        "keyframe_bytes": 0, "encode_s": 0.05, "upload_s": 0.02, "announce_s": 0.03})
        syncs.append({"t": end + 0.5, "worker": "w0", "version": k + 1, "kind": "delta", "bytes_fetched": 10,
                       "stage_s": 0.2, "swap_pause_s": 0.01, "verify_s": 0.0, "lag_s": 0.25, "rebuilt": False,
                       "manifest_at": end - 0.03})
        groups, completed = [], {}
        for j in range(2):
            pid = f"p{k}-{j}"
            start = end - 0.9 + 0.01 * j
            prompts.append({"t": start, "prompt_id": pid, "created_at": start - 0.05, "version": k})
            ids = [f"{pid}/{i}" for i in range(g)]
            for i, rid in enumerate(ids):
                rollouts.append({"worker": "w0", "rollout_id": rid, "prompt_id": pid, "group_index": i,
                                 "created_at": start + 0.2, "sampled_tokens": 20, "tokens": 30, "versions": [k, k],
                                 "timings": {"generate": 0.2, "env": 0.0, "total": 0.2}})
            groups.append({"prompt_id": pid, "rollout_ids": ids})
            completed[pid] = start + 0.35
        inputs.append({"t": end, "step": k, "version": k + 1, "groups": groups})
        completions.append({"t": end, "step": k, "completed_at": completed})
    write(run, "steps", step_lines)
    write(run, "inputs", inputs)
    write(run, "completions", completions)
    write(run, "weights", [{"t": t0, "version": 1, "kind": "keyframe", "full_bytes": 1000, "delta_bytes": 0,
                            "keyframe_bytes": 700, "encode_s": 0.05, "upload_s": 0.02, "announce_s": 0.03},
                           *weights])
    write(run, "syncs-w0", syncs)
    write(run, "rollouts-w0", rollouts)
    write(run, "prompts", prompts)


def test_measure_reads_parameters_and_figures_apart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    synthetic_run(run)
    measured = measure(run, load_config(None), workers=1)
    figures = measured.figures
    # steps 2..6 over 5 s: 20 rollouts trained, 10 dropped stale
    assert figures["trained_rollouts_per_min"] == pytest.approx(20 / 5 * 60)
    assert figures["stale_drop_fraction"] == pytest.approx(10 / 30)
    assert figures["staleness_mean_versions"] == pytest.approx(1.0)
    assert figures["sync_lag_mean_s"] == pytest.approx(0.25)
    p = measured.parameters
    assert p["decode_tokens_per_s_per_sequence"] == pytest.approx(100.0)
    assert p["sampled_tokens_median"] == pytest.approx(20.0)
    assert p["join_trip_s_median"] == pytest.approx(0.15)
    assert p["bus_hop_s"] == pytest.approx(0.25 - 0.2 - 0.01)
    assert p["admit_s"] == pytest.approx(0.01)
    fleet = measured.fleet
    assert fleet.model.delta_fraction == pytest.approx(0.01) and fleet.model.keyframe_fraction == pytest.approx(0.7)
    assert fleet.model.stage_samples and set(fleet.model.stage_samples) == {0.2}
    assert fleet.trainer.group_size == 8  # the run config's G (the defaults), not inferred from the log
    assert [r.name for r in fleet.region] == ["worker-0"]


def test_a_wan_run_gives_the_simulator_its_regions_and_links(tmp_path: Path) -> None:
    """``rlbus bench regions`` leaves a wan.json beside its run log: the fleet gets those regions and links."""
    run = tmp_path / "run"
    synthetic_run(run)
    (run / "wan.json").write_text(json.dumps({"home": "eu-west", "regions": [
        {"name": "eu-west", "workers": 1, "relay": True, "wan_latency_ms": 0.0, "wan_gbps": 10.0},
        {"name": "ap-south", "workers": 2, "relay": True, "wan_latency_ms": 90.0, "wan_gbps": 0.2},
        {"name": "idle", "workers": 0, "relay": False, "wan_latency_ms": 10.0, "wan_gbps": 1.0},
    ]}))
    fleet = measure(run, load_config(None), workers=3).fleet
    assert [(r.name, r.workers, r.wan_latency_ms, r.wan_gbps, r.relay) for r in fleet.region] == [
        ("eu-west", 1, 0.0, 10.0, True), ("ap-south", 2, 90.0, 0.2, True)]
    assert fleet.region[1].tokens_per_s == fleet.region[0].tokens_per_s  # per worker, as measured


def test_a_run_without_steps_is_a_clear_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    synthetic_run(run, steps=2)
    with pytest.raises(RunLogMissing, match="fewer than 3 trainer steps"):
        measure(run, load_config(None), workers=1)


def test_relative_error_uses_the_floor_under_small_measurements() -> None:
    assert relative_error(0.01, 0.0, FIGURES["stale_drop_fraction"]) == pytest.approx(0.2)
    assert relative_error(110.0, 100.0, FIGURES["trained_rollouts_per_min"]) == pytest.approx(0.1)
    assert relative_error(None, 1.0, 0.1) == 1.0


def test_a_run_config_replaces_the_fleets_training_settings(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[task]\nenv = "arith"\ngroup_size = 4\n[trainer]\ngroups_per_step = 3\nadmission = "published"\n'
                      'lr = 1e-5\n[trainer.grpo]\nmax_staleness = 1\n')
    fleet = with_run_config(load_fleet(ROOT / "infra/sim/composer2.toml"), load_config(config))
    t = fleet.trainer
    assert (t.groups_per_step, t.group_size, t.max_staleness, t.admission) == (3, 4, 1, "published")
    assert fleet.model.lr == 1e-5
    assert fleet.region[0].name == "us-west"  # the fleet's own tables stay
