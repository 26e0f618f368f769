"""``rlbus config check``: a config is checked before it runs, and every error names its field."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlbus.errors import ConfigError
from rlbus.launch.check import check_config, render_toml, resolved_tables
from rlbus.launch.config import config_from_dict

RUBRIC = Path(__file__).parents[3] / "infra" / "rlbus" / "rubrics" / "answer.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def failure(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_config(write(tmp_path, text), {})
    return info.value


def test_a_good_config_passes_and_prints_every_resolved_value(tmp_path: Path) -> None:
    checked = check_config(write(tmp_path, '[task]\nenv = "arith"\nenv_config = { digits = 2 }\n'
                                           "[trainer]\ngroups_per_step = 4\n"), {})
    assert any("'arith' builds from env_config" in note for note in checked.notes)
    text = render_toml(resolved_tables(checked.config))
    assert "groups_per_step = 4" in text
    assert "[task.env_config]\ndigits = 2" in text
    assert 'bootstrap = "127.0.0.1:9092"' in text  # a default filled in
    assert "[trainer.grpo]" in text and "max_staleness = " in text
    assert config_from_dict(tomllib.loads(text), {}) == checked.config  # what it prints loads back the same


def test_a_misspelt_field_names_it_and_the_closest_valid_name(tmp_path: Path) -> None:
    exc = failure(tmp_path, "[trainer]\ngroups_per_stp = 4\n")
    assert exc.field == "trainer.groups_per_stp"
    assert "did you mean `groups_per_step`?" in exc.problem
    nested = failure(tmp_path, "[trainer.grpo]\nmax_stalenes = 4\n")
    assert nested.field == "trainer.grpo.max_stalenes" and "`max_staleness`" in nested.problem
    table = failure(tmp_path, "[trainr]\nlr = 0.1\n")
    assert table.field == "trainr" and "did you mean `trainer`?" in table.problem


def test_a_missing_model_path_names_model_path(tmp_path: Path) -> None:
    exc = failure(tmp_path, f'[model]\nkind = "hf"\npath = "{tmp_path / "nowhere"}"\n')
    assert exc.field == "model.path"


def test_a_misspelt_model_name_suggests_the_shipped_one(tmp_path: Path) -> None:
    exc = failure(tmp_path, '[model]\nkind = "hf"\nname = "smollm2-135m-instrct"\n')
    assert exc.field == "model.name" and "did you mean `smollm2-135m-instruct`?" in exc.problem


def test_an_env_config_typo_names_task_env_config(tmp_path: Path) -> None:
    exc = failure(tmp_path, '[task]\nenv = "arith"\nenv_config = { digts = 2 }\n')
    assert exc.field == "task.env_config.digts"
    assert "did you mean `digits`?" in exc.problem


def test_an_unknown_env_suggests_the_closest_registered_one(tmp_path: Path) -> None:
    exc = failure(tmp_path, '[task]\nenv = "arth"\n')
    assert exc.field == "task.env"
    assert "did you mean `arith`?" in exc.problem


def test_a_judge_rubric_is_parsed(tmp_path: Path) -> None:
    good = check_config(write(tmp_path, f'[reward]\nkind = "judge"\n[reward.judge]\nrubric = "{RUBRIC}"\n'
                                        'backend = "engine"\nmodel = "tiny"\n'), {})
    assert any("parses" in note for note in good.notes)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[dimensions]]\nname = 3\n")
    exc = failure(tmp_path, f'[reward]\nkind = "judge"\n[reward.judge]\nrubric = "{bad}"\n')
    assert exc.field == "reward.judge.rubric" and str(bad) in exc.problem


def test_the_cli_prints_the_resolved_config_or_the_error(tmp_path: Path) -> None:
    from rlbus.cli.app import app

    runner = CliRunner()
    good = runner.invoke(app, ["config", "check", str(write(tmp_path, "[trainer]\ngroups_per_step = 4\n"))])
    assert good.exit_code == 0, good.output
    assert "[trainer]" in good.output and "groups_per_step = 4" in good.output
    bad = runner.invoke(app, ["config", "check", str(write(tmp_path, "[trainer]\ngroups_per_stp = 4\n"))])
    assert bad.exit_code == 1
    assert "trainer.groups_per_stp" in bad.output and "did you mean `groups_per_step`?" in bad.output


def test_a_prompt_file_is_checked_line_by_line(tmp_path: Path) -> None:
    from rlbus.errors import PromptFileError
    from rlbus.launch.check import check_config

    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"env": "answer", "text": "2+2?", "reference": "4"}\n')
    config = tmp_path / "run.toml"
    config.write_text(f'[task]\nprompts = "{problems}"\n[model]\nmax_seq = 256\n')
    assert any("1 valid prompt" in note for note in check_config(config, environ={}).notes)
    problems.write_text('{"env": "answer", "text": "2+2?", "reference": "4"}\n{"env": "answer", "txt": "x"}\n')
    with pytest.raises(PromptFileError, match=r"problems\.jsonl.*2"):
        check_config(config, environ={})


def test_a_prompt_that_cannot_fit_the_policy_names_model_max_seq_and_the_line(tmp_path: Path) -> None:
    """The newcomer's first JSONL run: the demo policy's 64-token context cannot hold a word problem with the
    answer format's instructions; every rollout worker would dead-letter every prompt. The check says so."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"env": "answer", "text": "1+1?", "reference": "2"}\n'
                        '{"env": "answer", "text": "Ann has 3 boxes of 12 eggs. How many eggs?", "reference": "36"}\n')
    error = failure(tmp_path, f'[task]\nprompts = "{problems}"\n')
    assert error.field == "model.max_seq"
    assert "line 1" in error.problem and "> max_seq 64" in error.problem and "raise [model] max_seq" in error.problem
    notes = check_config(write(tmp_path, f'[task]\nprompts = "{problems}"\n[model]\nmax_seq = 160\n'), {}).notes
    assert "model: every checked prompt and one turn fit max_seq 160 (the longest needs 159)" in notes
    error = failure(tmp_path, f'[task]\nprompts = "{problems}"\n[model]\nmax_seq = 158\n')
    assert "line 2" in error.problem and "159 > max_seq 158" in error.problem
    # a generated task's drawn prompts are checked too: the demo's arith fits its own policy
    assert any("fit max_seq 64" in note for note in check_config(write(tmp_path, "[task]\n"), {}).notes)
