"""JSONL prompt files: round trips, defaults, and errors that name the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.envs.tasks import generate_prompts
from rlbus.envs.tasks.jsonl import dump_prompts, load_prompts, validate_prompts
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


def test_lines_without_a_group_size_take_the_callers(tmp_path: Path) -> None:
    path = tmp_path / "sizes.jsonl"
    path.write_text('{"env": "arith", "text": "1+1=", "reference": "2"}\n'
                    '{"env": "arith", "text": "2+2=", "reference": "4", "group_size": 8}\n')
    assert [p.group_size for p in load_prompts(path, group_size=4)] == [4, 8]


def test_validate_prompts_counts_a_good_file_and_rejects_an_empty_or_missing_one(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"env": "answer", "text": "How many?", "reference": "1,234"}\n\n'
                    '{"env": "arith", "text": "1+1=", "reference": "2"}\n')
    assert validate_prompts(good) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    for path, problem in ((empty, "no prompts"), (tmp_path / "missing.jsonl", "cannot read")):
        with pytest.raises(PromptFileError) as caught:
            validate_prompts(path)
        assert caught.value.field == f"{path}:0" and problem in str(caught.value)


def test_a_reference_the_environment_cannot_check_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "refs.jsonl"
    path.write_text('{"env": "answer", "text": "How many?", "reference": "3"}\n'
                    '{"env": "answer", "text": "How many?", "reference": "three"}\n')
    with pytest.raises(PromptFileError) as caught:
        validate_prompts(path)
    assert caught.value.field == f"{path}:2" and "is not a number" in str(caught.value)
