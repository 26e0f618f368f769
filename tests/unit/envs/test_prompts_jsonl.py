"""JSONL prompt files: round trips, defaults, and errors that name the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.envs.tasks import generate_prompts
from rlbus.envs.tasks.jsonl import dump_prompts, load_prompts
from rlbus.errors import ConfigError, PromptFileError


def test_generated_prompts_round_trip(tmp_path: Path) -> None:
    prompts = [
        *generate_prompts("arith", seed=1, n=3),
        *generate_prompts("kv", seed=1, n=2, config={"hops": 2}),
        *generate_prompts("python_fn", seed=1, n=2),
    ]
    path = tmp_path / "set.jsonl"
    assert dump_prompts(prompts, path) == 7
    assert load_prompts(path) == prompts


def test_minimal_lines_get_defaults_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"env": "arith", "text": "1+1=", "reference": "2"}\n\n{"env": "strings", "text": "upper: a"}\n')
    first, second = load_prompts(path)
    assert (first.prompt_id, first.reference, first.group_size, first.env_config) == ("mine-1", "2", 8, {})
    assert (second.prompt_id, second.reference) == ("mine-3", None)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"env": "arith", "text": "1+1=", ', "not valid JSON"),
        ('{"env": "arith"}', "missing required field `text`"),
        ('{"env": "arith", "text": "x", "colour": "red"}', "unknown field `colour`"),
        ('{"env": "arith", "text": "x", "group_size": "8"}', "Expected `int`"),
        ('{"env": "nope", "text": "x"}', "unknown environment 'nope'"),
        ('{"env": "arith", "text": "x", "env_config": {"max_turns": -1}}', "env_config.max_turns"),
        ('["env", "arith"]', "Expected `object`"),
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"env": "arith", "text": "1+1=", "reference": "2"}\n' + line + "\n")
    with pytest.raises(PromptFileError) as caught:
        load_prompts(path)
    assert str(caught.value).startswith(f"{path}:2: ") and problem in str(caught.value)
    assert isinstance(caught.value, ConfigError) and caught.value.field == f"{path}:2"


def test_validation_can_be_skipped_for_environments_registered_later(tmp_path: Path) -> None:
    path = tmp_path / "later.jsonl"
    path.write_text('{"env": "not_yet", "text": "x"}\n')
    assert load_prompts(path, validate=False)[0].env == "not_yet"
