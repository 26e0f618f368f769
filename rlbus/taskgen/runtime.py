"""The Python packages hidden tests need inside the sandbox (pytest and hypothesis), as a plain directory.

The sandbox shows the program the host's /usr only (rlbus/sandbox/bwrap.py), and /usr's Python has no pytest,
while the rlbus venv may live anywhere (a pyenv under /root, say) that the sandbox cannot see. So the
generator copies the *installed* distributions of pytest and hypothesis, with their dependencies, from the
running interpreter's environment into one directory, which it hard-links into each world and puts on
PYTHONPATH. They are pure Python, so the sandbox's /usr/bin/python3 of the same minor version runs them.
The dist-info directories come along: hypothesis registers its pytest plugin through an entry point.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
from pathlib import Path

from rlbus.errors import GenerateError

#: The distributions the corpus's test suites may use (swe-format.md: pytest + hypothesis only).
ROOTS = ("pytest", "hypothesis")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def distributions(roots: tuple[str, ...] = ROOTS) -> list[metadata.Distribution]:
    """``roots`` and their unconditional runtime dependencies that this interpreter has installed."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as exc:
            if name in roots:
                raise GenerateError(f"the generator needs {name!r} installed in its interpreter") from exc
            continue
        seen[key] = dist
        for requirement in dist.requires or ():
            if ";" in requirement and not _applies(requirement.split(";", 1)[1]):
                continue
            if match := _NAME.match(requirement):
                todo.append(match.group(1))
    return [seen[k] for k in sorted(seen)]


def _applies(marker: str) -> bool:
    """Markers of a plain install on Linux/3.11: extras never, Windows never, python_version < 3.11 never."""
    text = marker.replace(" ", "")
    return not ("extra==" in text or "win32" in text or 'python_version<"3.11"' in text or "emscripten" in text)


def build(target: Path) -> Path:
    """Copy the runtime distributions' files into ``target`` (made fresh); returns it."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for dist in distributions():
        base = Path(str(dist.locate_file("")))
        for file in dist.files or ():
            parts = Path(str(file)).parts
            if not parts or parts[0] in ("..", "bin") or "__pycache__" in parts or str(file).endswith(".pyc"):
                continue
            source = base / file
            if source.is_file():
                destination = target / file
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)
    os.chmod(target, 0o755)
    return target


def link_tree(source: Path, target: Path) -> None:
    """Mirror ``source`` at ``target`` with hard links (same file system), copying where linking fails."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link, symlinks=True)
