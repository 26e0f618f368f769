"""Loading tasks: both formats into one RepoTask, and errors that name the file and the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlbus.envs.swe.task import load_tasks
from rlbus.errors import ConfigError, TaskFormatError
from tests.unit.envs.swe.conftest import CORPUS


def test_task_directories_load(corpus_tasks: dict) -> None:
    calc, text = corpus_tasks["calc-add"], corpus_tasks["textkit-words"]
    assert calc.source.kind == "repo" and calc.fail_to_pass == ("tests/test_calc.py::test_add",)
    assert "tests/test_calc.py" in calc.hidden_tests and calc.limits.max_turns == 8
    assert text.source.kind == "base" and text.source.patch and text.test_env == {"PYTHONPATH": "src"}
    assert text.metadata["library"] == "textkit"


def test_jsonl_rows_load(jsonl_file: Path) -> None:
    [task] = load_tasks([jsonl_file])
    assert task.source.kind == "git" and task.origin == "swe-bench"
    assert task.fail_to_pass == ("tests/test_counter.py::test_count", "tests/test_counter.py::test_missing")
    assert task.pass_to_pass == ("tests/test_counter.py::test_empty",)
    assert task.test_paths() == {"tests/test_counter.py"}


def _copy(tmp_path: Path) -> Path:
    dest = tmp_path / "calc-add"
    shutil.copytree(CORPUS / "calc-add", dest)
    return dest


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('fail_to_pass = ["tests/test_calc.py::test_add"]', "fail_to_pass = []", "tests.fail_to_pass"),
        ('fail_to_pass = ["tests/test_calc.py::test_add"]', 'fail_to_pass = ["not a node"]', "tests.fail_to_pass"),
        ('id = "calc-add"', 'id = "other"', "task.id"),
        ("max_turns = 8", "max_turns = -1", "limits.max_turns"),
        ("max_turns = 8", "max_turn = 8", "limits.max_turn"),
        ('source = "hand"', 'source = "web"', "task.source"),
        ("[tests]", '[tests]\ncommand = "make test"', "tests.command"),
    ],
)
def test_bad_task_toml_names_file_and_field(tmp_path: Path, old: str, new: str, field: str) -> None:
    task = _copy(tmp_path)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace(old, new))
    with pytest.raises(TaskFormatError) as info:
        load_tasks([task])
    assert str(toml) in str(info.value) and field in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_missing_parts_are_named(tmp_path: Path) -> None:
    task = _copy(tmp_path)
    (task / "solution" / "solution.patch").unlink()
    with pytest.raises(TaskFormatError, match=r"solution\.patch: missing"):
        load_tasks([task])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS"),
        ({"repo": "nowhere"}, "repo"),
        ({"patch": "just words"}, "patch"),
        ({"instance_id": "../x"}, "instance_id"),
    ],
)
def test_bad_rows_name_line_and_field(jsonl_file: Path, tmp_path: Path, change: dict, field: str) -> None:
    row = json.loads(jsonl_file.read_text())
    row.update(change)
    bad = jsonl_file.parent / f"bad-{field}.jsonl"
    bad.write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskFormatError) as info:
        load_tasks([bad])
    assert f"{bad}:2: {field}" in str(info.value)


def test_hidden_tests_named_in_the_base_are_read_from_it(tmp_path: Path) -> None:
    """A generated task names its hidden tests in the base archive instead of copying them."""
    import rlbus
    from rlbus.envs.swe.task import load_task_dir

    corpus = Path(rlbus.__file__).parent / "data" / "swe_tasks"
    shipped = next(p for p in sorted(corpus.iterdir()) if (p / "task.toml").is_file())
    task = tmp_path / shipped.name
    shutil.copytree(shipped, task)
    shutil.copytree(corpus / "_bases", tmp_path / "_bases")
    loaded = load_task_dir(task)
    assert loaded.hidden_tests and all(path.startswith("tests/") for path in loaded.hidden_tests)
    assert not (task / "tests").exists()

    toml = task / "task.toml"
    text = toml.read_text()
    toml.write_text(text.replace("hidden = [", 'hidden = [\n  "tests/no_such_test.py",'))
    with pytest.raises(TaskFormatError, match=r"tests\.hidden.*no_such_test\.py.*not a file of the base"):
        load_task_dir(task)
    toml.write_text(text.replace("hidden = [", 'hidden = [\n  "../escape.py",'))
    with pytest.raises(TaskFormatError, match=r"tests\.hidden.*not a repository-relative path"):
        load_task_dir(task)
