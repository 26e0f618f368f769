"""`rlbus eval`: held-out accuracy where RL starts (rebuilt from the config, deterministically) and at a
trainer checkpoint, which evaluates the checkpoint's weights, not the config's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlbus.errors import RlbusError
from rlbus.launch.config import load_config
from rlbus.launch.evaluation import evaluate_run
from rlbus.launch.roles import starting_model
from rlbus.training.checkpoint import TrainerState, save_checkpoint

RUN = """
[task]
env = "arith"
env_config = { digits = 1 }
[model]
d_model = 32
n_layer = 1
d_ff = 32
[trainer]
warm_steps = 30
teacher_error = 0.0
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(RUN)
    return path


def test_where_rl_starts_is_rebuilt_the_same_every_time(config_file: Path) -> None:
    config = load_config(config_file, environ={})
    first, second = starting_model(config, "t"), starting_model(config, "t")
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(),
                                                 strict=True))
    result = evaluate_run(config, n=8)
    assert result.model == "start" and result.step is None and result.prompts == 8
    assert 0.0 <= result.accuracy <= 1.0 and result.eval_set == "arith {'digits': 1}"


def test_a_checkpoint_is_evaluated_with_its_own_weights(config_file: Path, tmp_path: Path) -> None:
    config = load_config(config_file, environ={})
    model = starting_model(config, "t")
    with torch.no_grad():  # weights no config could rebuild: every logit the same, so every answer wrong
        for name, tensor in model.state_dict().items():
            if "head" in name or "embed" in name:
                tensor.zero_()
    saved = save_checkpoint(tmp_path / "ckpt", TrainerState(step=7, version=8, model=model.state_dict(),
                                                             model_description=model.describe()))
    by_dir = evaluate_run(config, checkpoint=tmp_path / "ckpt", n=8)
    by_file = evaluate_run(config, checkpoint=saved, n=8)
    assert (by_dir.step, by_dir.version, by_dir.model) == (7, 8, str(saved))
    assert by_file.accuracy == by_dir.accuracy == 0.0
    with pytest.raises(RlbusError, match="no trainer checkpoint"):
        evaluate_run(config, checkpoint=tmp_path / "empty-dir-that-does-not-exist", n=2)


def test_cli_prints_the_figure_and_fails_clearly(config_file: Path, tmp_path: Path) -> None:
    from rlbus.cli.app import app

    done = CliRunner().invoke(app, ["eval", "--config", str(config_file), "--n", "4"])
    assert done.exit_code == 0 and "held-out accuracy" in done.output and "where RL starts" in done.output
    missing = CliRunner().invoke(app, ["eval", "--config", str(config_file), "--checkpoint", str(tmp_path / "no")])
    assert missing.exit_code == 1 and "no trainer checkpoint" in missing.output
