"""`make gpu-check DRY=1`: the GPU check's stages rehearsed on the CPU at toy sizes, end to end, so CI keeps
the script that only a GPU machine runs for real in working order; and its sizing and target arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus_tools import gpu_check, randmodels

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_dry_run_rehearses_every_stage(tmp_path: Path) -> None:
    """The whole rehearsal in a fresh process (about a minute on a quiet 2-core machine): every stage that
    runs passes, the demo completes its steps, the decode bench's greedy rows equal transformers'."""
    out = tmp_path / "gpu-check.json"
    path = os.pathsep.join([str(ROOT), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "rlbus_tools.gpu_check", "--dry", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    stages = result["stages"]
    assert result["dry"] and result["targets"] == {}
    assert [s.name for s in gpu_check.STAGES] == list(stages)
    for name in ("tests", "decode", "train", "demo-smollm2"):
        assert stages[name]["status"] == "ok", (name, stages[name].get("log_tail"))
    assert stages["codec"]["status"] in ("ok", "not available")
    assert stages["demo-1.5b"]["status"] == stages["demo-7b"]["status"] == "skipped"
    assert stages["tests"]["figures"]["tests"] >= 5  # the CUDA tests were collected (and skip on a CPU)
    rows = {r["batch"]: r for r in stages["decode"]["figures"]["rows"]}
    assert set(rows) == {1, 4} and all(r["greedy_rows_equal"] == r["greedy_rows"] for r in rows.values())
    assert stages["train"]["figures"]["rows"][0]["mfu"] > 0
    demo = stages["demo-smollm2"]["figures"]["figures"]
    assert demo["completed"] and demo["steps"] == 2


def test_the_7b_demo_keeps_the_blocks_that_fit() -> None:
    assert gpu_check.demo_layers(1000.0) == 28
    layers = gpu_check.demo_layers(139.0)
    assert 1 <= layers < 28
    assert 20 * randmodels.params("qwen2.5-7b", layers=layers) <= 0.75 * 139 * 2**30
    assert 20 * randmodels.params("qwen2.5-7b", layers=layers + 1) > 0.75 * 139 * 2**30


def test_targets_read_the_figures() -> None:
    stages = {
        "decode": {"figures": {"rows": [{"batch": 1, "engine_step_ms": 8.2, "speedup": 3.0},
                                        {"batch": 64, "engine_step_ms": 12.0, "speedup": 1.2}]}},
        "train": {"status": "timed out", "figures": None},
    }
    t = gpu_check.targets(stages, dry=False)
    assert t["engine_step_ms_batch_1"]["met"] and not t["engine_speedup_batch_64"]["met"]
    assert t["trainer_mfu_1p5b"] == {"value": None, "target": ">= 0.30", "met": False}


def test_model_configs_have_the_published_sizes() -> None:
    assert round(randmodels.params("smollm2-135m") / 1e6, 1) == 134.5
    assert round(randmodels.params("qwen2.5-1.5b") / 1e9, 2) == 1.54
    assert round(randmodels.params("qwen2.5-7b") / 1e9, 2) == 7.62
    model = randmodels.build("toy")
    assert sum(p.numel() for p in model.parameters()) == randmodels.params("toy")
