"""The shipped corpus (rlbus/data/swe_tasks) has every file and field swe-format.md requires.

Structure only, and fast: running each task's tests is `rlbus env check`'s job, not a unit test's.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tomllib
from pathlib import Path

import pytest

import rlbus
from rlbus.taskgen import patches, taskdir

CORPUS = Path(rlbus.__file__).parent / "data" / "swe_tasks"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())
TASKS = MANIFEST["tasks"]


def test_manifest_has_enough_tasks_from_enough_libraries() -> None:
    assert MANIFEST["version"] == 1
    assert len(TASKS) >= 50
    assert len({entry["library"] for entry in TASKS}) >= 3
    assert len({entry["id"] for entry in TASKS}) == len(TASKS)
    listed = {entry["path"] for entry in TASKS}
    on_disk = {p.name for p in CORPUS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert listed == on_disk  # no unlisted task directories, no missing ones


def test_corpus_stays_small() -> None:
    size = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    assert size < 5 * 1024 * 1024


@pytest.fixture(scope="module")
def base_files() -> dict[str, set[str]]:
    files = {}
    for archive in (CORPUS / taskdir.BASES).glob("*.tar.gz"):
        with tarfile.open(archive) as tar:
            files[archive.name] = set(tar.getnames())
    return files


@pytest.mark.parametrize("entry", TASKS, ids=[entry["id"] for entry in TASKS])
def test_task_directory_matches_the_format(entry: dict, base_files: dict[str, set[str]]) -> None:
    task = CORPUS / entry["path"]
    for name in taskdir.REQUIRED_FILES:
        assert (task / name).is_file(), name
    assert (task / "instruction.md").read_text().strip()
    config = tomllib.loads((task / "task.toml").read_text())
    assert config["task"] == {"id": entry["id"], "version": 1, "source": "generated"}
    assert entry["id"] == task.name
    base = (task / config["environment"]["base"]).resolve()
    assert base.parent == (CORPUS / taskdir.BASES).resolve() and base.is_file()
    assert (task / config["environment"]["patch"]).is_file()

    tests = config["tests"]
    assert "{tests}" in tests["command"]
    f2p, p2p = tests["fail_to_pass"], tests["pass_to_pass"]
    assert entry["fail_to_pass"] == len(f2p) >= 1 and entry["pass_to_pass"] == len(p2p)
    assert not set(f2p) & set(p2p)
    assert not (task / "tests").exists()  # the hidden tests are the base's files, named, not copied
    hidden = set(tests["hidden"])
    assert hidden <= base_files[base.name]
    for nodeid in f2p + p2p:
        path = nodeid.split("::", 1)[0]
        assert path in hidden, nodeid  # the file the grader restores
    if "env" in tests:
        assert tests["env"] == {"PYTHONPATH": "src"}

    metadata = config["metadata"]
    assert metadata["library"] == entry["library"] and metadata["version"] == entry["version"]
    assert metadata["bug_kind"] in {"flip_comparison", "invert_condition", "off_by_one", "swap_arguments",
                                    "drop_guard", "change_constant", "swap_operator"}  # fmt: skip
    checked = entry["checked"]
    assert checked["solution_reward"] == 1.0 and checked["unchanged_reward"] == 0.0


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    roots = {}
    for archive in (CORPUS / taskdir.BASES).glob("*.tar.gz"):
        root = tmp_path_factory.mktemp(archive.name.removesuffix(".tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        roots[archive.name] = root
    return roots


@pytest.mark.parametrize("entry", TASKS, ids=[entry["id"] for entry in TASKS])
def test_solution_undoes_the_bug(entry: dict, bases: dict[str, Path], tmp_path: Path) -> None:
    task = CORPUS / entry["path"]
    config = tomllib.loads((task / "task.toml").read_text())
    repo = tmp_path / "repo"
    shutil.copytree(bases[Path(config["environment"]["base"]).name], repo)
    bug = (task / "environment" / "bug.patch").read_text()
    path = bug.splitlines()[0].split(" b/", 1)[1]
    original = (repo / path).read_text()
    patches.apply(repo, bug)
    assert (repo / path).read_text() != original
    patches.apply(repo, (task / "solution" / "solution.patch").read_text())
    assert (repo / path).read_text() == original
