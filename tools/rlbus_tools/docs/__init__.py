"""The documentation site's generated pages: reference pages written from the code itself, so they cannot drift.

``python -m rlbus_tools.docs`` (``make docs`` runs it before ``mkdocs build``) writes every page of
:data:`PAGES` under ``docs/``; with ``--check`` it only compares, and fails naming the stale pages.
tests/unit/test_docs.py runs the same comparison, so a change to a config field's ``#:`` doc, a CLI option, a
topic or a schema that is not regenerated fails the suite.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlbus_tools.docs import cli_page, config_page, metrics_page, topics_page

#: Generated pages, by path under docs/, and the function that renders each.
PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_page.render,
    "reference/cli.md": cli_page.render,
    "reference/topics.md": topics_page.render_topics,
    "reference/schemas.md": topics_page.render_schemas,
    "reference/metrics.md": metrics_page.render,
}


def stale(docs: Path) -> list[str]:
    """The generated pages under ``docs`` that differ from what the code renders now (or are missing)."""
    return [name for name, render in PAGES.items()
            if not (docs / name).is_file() or (docs / name).read_text() != render()]


def write(docs: Path) -> list[str]:
    """Write every generated page under ``docs``; returns the pages that changed."""
    changed = []
    for name, render in PAGES.items():
        path = docs / name
        text = render()
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(name)
    return changed
