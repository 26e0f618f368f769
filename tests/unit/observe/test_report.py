"""`rlbus report` on a synthetic run directory written through RunLog: every plot, the headline figures,
outcome counts from summary.json, and a clear error for a directory without a run log."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlbus.cli.app import app
from rlbus.errors import RunLogMissing
from rlbus.observe.report import PLOTS, RunData, merge_histograms, summary_markdown, write_report
from rlbus.observe.runlog import REWARDS, STEPS, WEIGHTS, RunLog, syncs_name

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, summary: bool = True) -> None:
    clock = iter(float(t) for t in range(1000, 2000))
    with RunLog(run_dir, clock=lambda: next(clock)) as log:
        log.write(WEIGHTS, {"version": 1, "kind": "keyframe", "full_bytes": 100_000, "delta_bytes": 0,
                            "keyframe_bytes": 90_000})
        for step in range(1, 11):
            log.write(STEPS, {
                "step": step, "version": step + 1, "reward_mean": step / 10, "kl_k3": 1e-3 * step,
                "max_abs_dlogprob": 0.1 * step, "is_ess": 0.95, "router_flip_rate": 0.02, "rollouts": 16,
                "staleness": {0: 12, 1: 3, 2: 1},
            })
            log.write(WEIGHTS, {"version": step + 1, "kind": "delta", "full_bytes": 100_000,
                                "delta_bytes": 2_000 + step, "keyframe_bytes": 0})
            for worker in ("rollout-0", "rollout-1"):
                log.write(syncs_name(worker), {"worker": worker, "version": step + 1, "kind": "delta",
                                               "bytes_fetched": 2_000, "stage_s": 0.01,
                                               "swap_pause_s": 0.001 * step, "lag_s": 0.2, "rebuilt": False})
            log.write(REWARDS, {"source": "verifier", "value": float(step % 2), "rollout_id": f"r{step}"})
        if summary:
            log.summary({"accuracy_start": 0.25, "accuracy_end": 0.5, "wall_s": 301.5, "steps": 10,
                         "outcomes": {"trained": 160, "dropped_stale": 4, "duplicate": 0, "dead_lettered": 1}})


def test_report_writes_every_plot_and_the_summary(tmp_path: Path) -> None:
    write_run(tmp_path)
    written = write_report(tmp_path)
    assert [p.name for p in written] == [*PLOTS, "report.md"]
    for name in PLOTS:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 15_000, name
    text = (tmp_path / "report.md").read_text()
    assert "| trainer steps logged | 10 over" in text
    assert "| policy versions | 2 → 11 |" in text
    assert "| rollouts trained | 160 |" in text
    assert "| mean reward, first / last 5 steps | 0.300 → 0.800 |" in text
    assert "| staleness of trained rollouts | 75 % on-policy, max 2 versions behind |" in text
    assert "mean 2,006 B of 100,000 B (2.01 %) over 10 versions" in text
    assert "p99 10.00 ms, max 10.00 ms over 20 swaps, 2 workers" in text
    assert "| dropped_stale | 4 |" in text and "| trained | 160 |" in text
    assert "| wall_s | 301.5 |" in text
    assert "![mismatch](mismatch.png)" in text


def test_a_partial_log_names_what_is_missing(tmp_path: Path) -> None:
    with RunLog(tmp_path) as log:
        log.write(STEPS, {"step": 1, "version": 2, "reward_mean": 0.5, "kl_k3": 1e-3, "staleness": {"0": 4}})
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Not in this run log: weights.jsonl, rewards.jsonl, syncs-*.jsonl" in text


def test_a_directory_without_a_run_log_fails_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(RunLogMissing, match=r"steps\.jsonl not found"):
        RunData.load(tmp_path)
    with pytest.raises(RunLogMissing, match="no such run directory"):
        RunData.load(tmp_path / "absent")


def test_cli_report_into_another_directory(tmp_path: Path) -> None:
    runner = CliRunner()
    run, out = tmp_path / "run", tmp_path / "out"
    failed = runner.invoke(app, ["report", str(tmp_path)])
    assert failed.exit_code == 1
    assert "steps.jsonl not found" in failed.output  # one line, never wrapped inside a path
    write_run(run, summary=False)
    done = runner.invoke(app, ["report", str(run), "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert "report.md" in done.output
    assert sorted(p.name for p in out.iterdir()) == sorted([*PLOTS, "report.md"])
    assert "No summary.json" in (out / "report.md").read_text()
    assert not (run / "report.md").exists()


def test_histograms_from_json_merge_by_integer_key() -> None:
    assert merge_histograms([{"0": 2, "1": 1}, {0: 3, 2: 1}]) == {0: 5, 1: 1, 2: 1}


def test_summary_markdown_of_a_log_with_steps_only(tmp_path: Path) -> None:
    data = RunData(run_dir=tmp_path, steps=[{"t": 0.0, "step": 1, "reward_mean": 0.0}])
    assert "| trainer steps logged | 1 over 0 s |" in summary_markdown(data)
