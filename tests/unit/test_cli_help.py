"""``--help`` reads as written: config tables in square brackets survive, each main command has an example."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rlbus.cli.app import app


def help_of(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def test_config_tables_in_square_brackets_are_shown_literally() -> None:
    assert "[trainer]" in help_of("up")
    assert "[dpo]" in help_of("train", "dpo")


@pytest.mark.parametrize("command", [("up",), ("worker",), ("serve",), ("train", "dpo"), ("config", "check")])
def test_the_main_commands_show_an_example(command: tuple[str, ...]) -> None:
    assert f"Example: rlbus {' '.join(command)} " in help_of(*command)


def test_models_list_shows_whole_names() -> None:
    result = CliRunner().invoke(app, ["models", "list"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-instruct" in result.output
