"""Source distributions from the package index: download once into a cache, extract, find code and tests.

A generated task starts from a library exactly as its authors released it, so the generator works from the
sdist (``pip download --no-binary :all: --no-deps NAME==VER``), which — unlike a wheel — usually ships the
test suite. The cache lives under ``$RLBUS_HOME/swegen/sdists`` (default ``~/.cache/rlbus``), so
regenerating a corpus downloads nothing. `Library` describes the extracted tree: where the importable code
is (flat or ``src/`` layout), which files are tests, and which of them the snapshot keeps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.errors import GenerateError

_SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
#: Top-level entries a snapshot leaves out: documentation, build metadata, CI — nothing tests import.
_SKIP_TOP = {"docs", "doc", "build", "dist", ".github", ".git", "benchmarks", "examples", "changelog.d"}
_SKIP_ANY = {"__pycache__", ".pytest_cache", ".hypothesis", ".tox", ".mypy_cache"}


def home() -> Path:
    """``$RLBUS_HOME`` (default ``~/.cache/rlbus``)."""
    return Path(os.environ.get("RLBUS_HOME") or Path.home() / ".cache" / "rlbus")


def parse_spec(spec: str) -> tuple[str, str]:
    """``NAME==VERSION`` → (name, version); the version is required so a corpus is reproducible."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise GenerateError(f"library {spec!r}: expected NAME==VERSION (a pinned release), e.g. toolz==0.12.1")
    return match.group(1), match.group(2)


def fetch(spec: str, *, cache: Path | None = None) -> Path:
    """The sdist archive of ``spec``, downloaded with pip into the cache unless it is already there."""
    name, version = parse_spec(spec)
    directory = cache or home() / "swegen" / "sdists"
    directory.mkdir(parents=True, exist_ok=True)
    found = _cached(directory, name, version)
    if found is not None:
        return found
    command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", str(directory), f"{name}=={version}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    found = _cached(directory, name, version)
    if done.returncode != 0 or found is None:
        raise GenerateError(f"could not download the sdist of {name}=={version}: {done.stderr.strip()[-500:]}")
    return found


def _cached(directory: Path, name: str, version: str) -> Path | None:
    stems = {f"{variant}-{version}" for variant in (name, name.replace("-", "_"), name.replace("_", "-"))}
    stems |= {stem.lower() for stem in stems}
    for path in sorted(directory.iterdir()):
        for suffix in (".tar.gz", ".zip", ".tgz"):
            if path.name.endswith(suffix) and path.name[: -len(suffix)] in stems:
                return path
    return None


def extract(archive: Path, target: Path) -> Path:
    """Unpack ``archive`` into ``target`` (made fresh) and return the project root (its single top dir)."""
    target.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(target)
    else:
        with tarfile.open(archive) as t:
            t.extractall(target, filter="data")
    entries = [p for p in target.iterdir() if p.is_dir()]
    if len(entries) != 1:
        raise GenerateError(f"{archive.name}: expected one top-level directory, found {len(entries)}")
    return entries[0]


def is_test_file(relative: str) -> bool:
    name = relative.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


@dataclass
class Library:
    """An extracted sdist: its name and version, its root, and where code and tests are."""

    name: str
    version: str
    root: Path
    src: str = ""
    """"src" for a src-layout project (tests then need PYTHONPATH=src), "" for a flat one."""
    files: list[str] = field(default_factory=list)
    """Every file the snapshot keeps, repository-relative, sorted."""

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def test_files(self) -> list[str]:
        return [f for f in self.files if is_test_file(f)]

    @property
    def source_files(self) -> list[str]:
        """Library modules a bug may go into: importable .py files that are not tests or build scripts."""
        out = []
        for f in self.files:
            parts = f.split("/")
            if not f.endswith(".py") or is_test_file(f) or parts[-1] in ("conftest.py", "setup.py"):
                continue
            if any(p in ("tests", "test", "testing") for p in parts[:-1]) or parts[-1].startswith("_version"):
                continue
            if self.src and parts[0] != self.src:
                continue
            if not self.src and len(parts) == 1 and parts[0] in ("versioneer.py", "benchmark.py", "noxfile.py"):
                continue
            out.append(f)
        return out


def load(name: str, version: str, root: Path) -> Library:
    """Describe the project at ``root``; GenerateError when it has no tests or no code."""
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts[0] in _SKIP_TOP or relative.parts[0].endswith(".egg-info"):
            continue
        if any(part in _SKIP_ANY for part in relative.parts) or not path.is_file() or path.is_symlink():
            continue
        if path.suffix in (".pyc", ".pyo", ".so"):
            continue
        files.append(relative.as_posix())
    library = Library(name, version, root, "src" if (root / "src").is_dir() else "", files)
    if not library.test_files:
        raise GenerateError(f"{library.key}: the sdist ships no test files (test_*.py / *_test.py)")
    if not library.source_files:
        raise GenerateError(f"{library.key}: no library modules found")
    return library
