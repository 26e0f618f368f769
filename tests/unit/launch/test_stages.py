"""The offline stages of a run config: `rlbus train dpo` (SFT → DPO → gate → checkpoint) and the trainer's
DPO stage before RL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlbus.cli.app import app
from rlbus.errors import QualityGateFailed
from rlbus.launch.config import load_config

SMALL = """
[task]
env = "arith"
env_config = { digits = 1 }
[trainer]
warm_steps = 40
teacher_error = 0.5
[dpo]
task_pairs = 120
eval_fraction = 0.25
[dpo.train]
steps = 30
lr = 3e-3
batch_size = 16
"""


@pytest.mark.slow
def test_train_dpo_learns_the_task_pairs_and_writes_a_checkpoint_rl_starts_from(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(SMALL)
    out = tmp_path / "dpo"
    result = CliRunner().invoke(app, ["train", "dpo", "--config", str(cfg), "--out", str(out), "--eval-size", "10",
                                      "--baseline-sft", "--json", str(tmp_path / "dpo.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "dpo.json").read_text())["summary"]
    assert summary["eval_pref_accuracy_end"] >= summary["eval_pref_accuracy_start"] + 0.2
    assert summary["eval_margin_end"] > summary["eval_margin_start"] and summary["tokens_per_s"] > 0
    assert 0.0 <= summary["task_accuracy_end"] <= 1.0 and summary["gate_passed"] is True
    assert set(summary["sft_baseline"]) == {"eval_pref_accuracy_end", "task_accuracy_end"}
    # the RL run starts from the checkpoint: same weights, the model rebuilt from its description
    import msgspec

    from rlbus.launch.arguments import initial_model, model_source
    from rlbus.training.checkpoint import load_checkpoint

    run = load_config(None, {})
    run = msgspec.structs.replace(run, model=msgspec.structs.replace(run.model, checkpoint=str(out)))
    model = initial_model(run)
    saved = load_checkpoint(out)
    assert saved is not None and all(torch.equal(model.state_dict()[k], v) for k, v in saved.model.items())
    assert model_source(run).kind == "policy"


def test_a_missed_gate_fails_the_command_and_the_trainers_stage(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(SMALL.replace("steps = 30", "steps = 1").replace("warm_steps = 40", "warm_steps = 0")
                   .replace("[dpo]\n", "[dpo]\ngate_accuracy = 1.0\n"))
    result = CliRunner().invoke(app, ["train", "dpo", "--config", str(cfg), "--out", str(tmp_path / "o"),
                                      "--eval-size", "4"])
    assert result.exit_code == 1 and "quality gate missed" in result.output
    from rlbus.launch.roles import _dpo_stage
    from rlbus.models.policy_source import PolicySource

    run = load_config(cfg, {})
    source = PolicySource(run.model.options)
    with pytest.raises(QualityGateFailed, match=r"gate_accuracy = 1\.0"):
        _dpo_stage(source.build(), source, run, "trainer-test")
