"""The generator end to end on a tiny local library (tests/fixtures/swegen), no network: the sdist comes
from a pre-filled cache, every test run goes through the real bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import json
import shutil
import tarfile
import tomllib
from pathlib import Path

import pytest

from rlbus.envs.swe.task import load_task_dir
from rlbus.errors import GenerateError
from rlbus.taskgen import patches, sdist, taskdir, verify
from rlbus.taskgen.generate import GenerateOptions, LibraryResult, generate

FIXTURE = Path(__file__).parents[2] / "fixtures" / "swegen" / "minilib-1.0"


def _cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir()
    with tarfile.open(cache / "minilib-1.0.tar.gz", "w:gz") as tar:
        tar.add(FIXTURE, arcname="minilib-1.0", filter=lambda info: None if "__pycache__" in info.name else info)
    return cache


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LibraryResult, list[str]]:
    root = tmp_path_factory.mktemp("swegen")
    out, lines = root / "corpus", []
    options = GenerateOptions(libraries=["minilib==1.0"], tasks=2, seed=3, out=out, cache=_cache(root))
    (result,) = asyncio.run(generate(options, lines.append))
    return out, result, lines


@pytest.mark.slow
def test_fixture_library_to_validated_tasks(generated: tuple[Path, LibraryResult, list[str]], tmp_path: Path) -> None:
    out, result, lines = generated
    assert result.made == 2 and result.baseline_tests == 9
    assert any("9 tests pass unchanged" in line for line in lines)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 1 and len(manifest["tasks"]) == 2
    base = out / "_bases" / "minilib-1.0.tar.gz"
    with tarfile.open(base) as tar:
        names = tar.getnames()
    assert "minilib/__init__.py" in names and "tests/test_minilib.py" in names and "setup.py" in names

    for entry in manifest["tasks"]:
        task = out / entry["path"]
        config = tomllib.loads((task / "task.toml").read_text())
        assert config["task"] == {"id": entry["id"], "version": 1, "source": "generated"}
        assert (task / config["environment"]["base"]).resolve() == base.resolve()
        f2p, p2p = config["tests"]["fail_to_pass"], config["tests"]["pass_to_pass"]
        assert entry["fail_to_pass"] == len(f2p) >= 1 and entry["pass_to_pass"] == len(p2p)
        assert not set(f2p) & set(p2p)
        assert all(nodeid.startswith("tests/test_minilib.py::test_") for nodeid in f2p + p2p)
        assert config["tests"]["hidden"] == ["tests/test_minilib.py"] and not (task / "tests").exists()
        loaded = load_task_dir(task)  # the named file is read from the base archive, byte for byte
        assert loaded.hidden_tests == {"tests/test_minilib.py": (FIXTURE / "tests" / "test_minilib.py").read_bytes()}
        assert entry["checked"]["solution_reward"] == 1.0 and entry["checked"]["unchanged_reward"] == 0.0
        assert config["metadata"]["function"] in ("clamp", "windows", "mean")  # never the untested function

        # the bug over the base is the mutant; the solution over that is the release again
        repo = tmp_path / entry["id"]
        with tarfile.open(base) as tar:
            tar.extractall(repo, filter="data")
        original = (repo / "minilib/__init__.py").read_text()
        patches.apply(repo, (task / config["environment"]["patch"]).read_text())
        assert (repo / "minilib/__init__.py").read_text() != original
        patches.apply(repo, (task / "solution/solution.patch").read_text())
        assert (repo / "minilib/__init__.py").read_text() == original

        instruction = (task / "instruction.md").read_text()
        assert f2p[0] in instruction and "minilib 1.0" in instruction
        bug_lines = [line[1:].strip() for line in (task / "environment/bug.patch").read_text().splitlines()
                     if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]  # fmt: skip
        assert not any(line and line in instruction for line in bug_lines)  # neither the bug nor the fix


@pytest.mark.slow
def test_written_tasks_check_out_from_their_files_and_a_broken_one_does_not(
    generated: tuple[Path, LibraryResult, list[str]], tmp_path: Path
) -> None:
    out = tmp_path / "corpus"
    shutil.copytree(generated[0], out)
    verdicts = asyncio.run(verify.verify(out))
    assert [v.ok for v in verdicts] == [True, True]

    first, second = (out / v.id for v in verdicts)
    (first / "solution" / "solution.patch").write_text((first / "environment" / "bug.patch").read_text())
    setup = (FIXTURE / "setup.py").read_text()
    (second / "solution" / "solution.patch").write_text(patches.diff("setup.py", setup, setup + "# no fix\n"))
    tampered = asyncio.run(verify.verify(out))
    assert not tampered[0].ok and "does not apply" in tampered[0].reason  # the bug twice
    assert not tampered[1].ok and "solution does not pass" in tampered[1].reason  # applies, fixes nothing


def test_a_library_without_tests_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with tarfile.open(cache / "minilib-1.0.tar.gz", "w:gz") as tar:
        tar.add(FIXTURE / "minilib", arcname="minilib-1.0/minilib")
    options = GenerateOptions(libraries=["minilib==1.0"], tasks=1, out=tmp_path / "out", cache=cache)
    with pytest.raises(GenerateError, match="ships no test files"):
        asyncio.run(generate(options))


def test_library_spec_must_be_pinned() -> None:
    with pytest.raises(GenerateError, match="NAME==VERSION"):
        sdist.parse_spec("toolz")
    assert sdist.parse_spec("more-itertools==10.2.0") == ("more-itertools", "10.2.0")


def test_base_archives_are_reproducible(tmp_path: Path) -> None:
    taskdir.write_base(FIXTURE, ["setup.py", "minilib/__init__.py"], tmp_path / "a.tar.gz")
    taskdir.write_base(FIXTURE, ["minilib/__init__.py", "setup.py"], tmp_path / "b.tar.gz")
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
