"""The Python the coding tasks' tests run with inside the sandbox, and the shared cache it lives in.

The sandbox shows only the host's ``/usr`` (`rlbus.sandbox`), so the interpreter is the system
``python3`` there (`rlbus.sandbox.find_python`). pytest and hypothesis come from the *worker's own*
installation — CI installs ``.[dev]``, which has both — copied once into a runtime directory
(``<cache>/runtime-<hash>/site``), with a ``bin/`` holding ``python`` / ``pytest``. The runtime is mounted
read-only at ``/opt/rlbus`` in every episode and grading sandbox; ``PATH`` starts with ``/opt/rlbus/bin``
and ``PYTHONPATH`` with ``/opt/rlbus/site``, so the agent's ``python -m pytest`` works like the grader's.
The launcher is not part of it: it sits in a directory of its own (`grader_dir`, ``<cache>/grader-<hash>``)
mounted at ``/opt/rlbus-grader`` in grading sandboxes only, so an episode cannot read the program its patch
will be graded by. Only pure-Python distributions are copied, so the system interpreter's minor version may
differ from the worker's (3.11 here, 3.12 on a fresh Ubuntu).
Nothing is downloaded; a worker without pytest installed gets a `SandboxError` saying so.

The cache (``$RLBUS_SWE_CACHE``, default ``<tmp>/rlbus-swe-<uid>``) also holds the per-task repository
templates (`rlbus.envs.swe.world`). It must be readable by the sandbox's uid — a root worker runs bwrap as
an unprivileged uid that cannot enter ``/root`` — so it lives in the temp directory, is created 0755, and
is refused when it is a symlink or belongs to someone else (a squatted temp path).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

from rlbus.errors import SandboxError
from rlbus.sandbox import find_python

#: Where the runtime appears inside the sandbox.
INNER = "/opt/rlbus"
#: Where the launcher appears inside a grading sandbox (never in an episode's).
GRADER_INNER = "/opt/rlbus-grader"
#: Distributions copied into the runtime: pytest and its dependencies, hypothesis and its.
DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "hypothesis", "attrs", "sortedcontainers")
_OPTIONAL = ("exceptiongroup", "tomli")  # pytest's backports on Python < 3.11
_LAUNCHER = tuple(
    Path(__file__).parent / "grading" / f"grader_{n}.py" for n in ("main", "runner", "guard", "values", "seccomp")
)
#: hypothesis's pytest plugin (an entry point, but plugin autoloading is off: the repository's own
#: ``*.dist-info`` could otherwise register plugins), loaded by name instead.
HYPOTHESIS_PLUGIN = "_hypothesis_pytestplugin"


def cache_root() -> Path:
    """The shared cache directory (created on first use); see the module docstring."""
    root = Path(os.environ.get("RLBUS_SWE_CACHE") or Path(tempfile.gettempdir()) / f"rlbus-swe-{os.geteuid()}")
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(root)
    if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.geteuid():
        raise SandboxError(f"{root} is not a directory owned by this user; set RLBUS_SWE_CACHE elsewhere")
    os.chmod(root, 0o755)
    return root


@cache
def runtime_dir() -> Path:
    """The runtime directory for this installation, built on first use (atomically: built aside, renamed)."""
    dists = []
    for name in (*DISTRIBUTIONS, *_OPTIONAL):
        try:
            dists.append(importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            if name in DISTRIBUTIONS:
                raise SandboxError(
                    f"the coding environment's test runtime needs {name!r} installed in the worker's Python"
                    " (pip install 'rlbus[dev]')"
                ) from None
    python = find_python()
    key = hashlib.sha256(python.encode())
    for d in dists:
        key.update(f"{d.metadata['Name']}=={d.version}".encode())
    target = cache_root() / f"runtime-{key.hexdigest()[:16]}"

    def fill(build: Path) -> None:
        site = build / "site"
        for dist in dists:
            _copy_distribution(dist, site)
        (build / "bin").mkdir()
        os.symlink(python, build / "bin" / "python")
        os.symlink(python, build / "bin" / "python3")
        (build / "bin" / "pytest").write_text(f'#!/bin/sh\nexec {python} -m pytest "$@"\n')

    return _built_once(target, fill)


@cache
def grader_dir() -> Path:
    """The launcher's directory (``grader_main.py``, its test process ``grader_runner.py`` and that
    process's audit hook ``grader_guard.py``), built on first use like the runtime; named by their hash, so
    a new launcher gets a new directory."""
    sources = {path.name: path.read_bytes() for path in _LAUNCHER}
    digest = hashlib.sha256(b"".join(sources[name] for name in sorted(sources))).hexdigest()[:16]

    def fill(build: Path) -> None:
        for name, source in sources.items():
            (build / name).write_bytes(source)

    return _built_once(cache_root() / f"grader-{digest}", fill)


def _built_once(target: Path, fill: Callable[[Path], object]) -> Path:
    """``target``, built by ``fill`` on first use: in a directory beside it, made world-readable, marked
    ``ready`` and renamed into place, so a reader never sees half of it and concurrent builders agree."""
    if (target / "ready").exists():
        return target
    build = Path(tempfile.mkdtemp(prefix=f"{target.name}-build-", dir=cache_root()))
    try:
        fill(build)
        (build / "ready").write_text("")
        _world_readable(build)
        try:
            os.rename(build, target)
        except OSError:  # another process finished first
            if not (target / "ready").exists():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return target


def runtime_env(extra_paths: list[str] | None = None) -> dict[str, str]:
    """The variables every sandbox of the coding environment gets (``extra_paths``: inner directories
    appended to PYTHONPATH, e.g. the repository's ``src``)."""
    return {
        "PATH": f"{INNER}/bin:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": ":".join([f"{INNER}/site", *(extra_paths or [])]),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTEST_PLUGINS": HYPOTHESIS_PLUGIN,
        "HYPOTHESIS_STORAGE_DIRECTORY": "/sandbox/.hypothesis",
    }


def _copy_distribution(dist: importlib.metadata.Distribution, site: Path) -> None:
    for entry in dist.files or ():
        rel = Path(str(entry))
        if rel.is_absolute() or ".." in rel.parts or "__pycache__" in rel.parts or rel.suffix == ".pyc":
            continue  # console scripts (../../bin/pytest) and caches
        source = Path(str(dist.locate_file(entry)))
        if source.is_file():
            dest = site / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)


def _world_readable(root: Path) -> None:
    for dirpath, _dirs, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
