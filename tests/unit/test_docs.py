"""The documentation site stays true: the generated reference pages equal what the code renders now, the site
builds with ``mkdocs build --strict`` (a broken link or anchor, a page left out of the nav fails it), the built
pages load nothing from the network, and README.md — the front door — stays short and its links resolve.

The strict build takes about two seconds (mkdocs with the Material theme, 37 pages).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from rlbus.launch.config import SET_BY_THE_RUN, RunConfig
from rlbus_tools.docs import PAGES, stale
from rlbus_tools.docs.config_page import fields, toml_type
from rlbus_tools.docs.markdown import GENERATED, docstring
from rlbus_tools.docs.source import field_docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


class _Documented(msgspec.Struct):
    """A struct documented both ways Sphinx reads."""

    #: Above the field,
    #: over two lines.
    above: int = 1
    below: str = "x"
    """Below the field."""
    #: Both: above …
    both: bool = True
    """… and below."""
    bare: float = 0.0


def test_field_docs_are_read_from_comments_above_and_strings_below() -> None:
    docs = field_docs(_Documented)
    assert docs == {
        "above": ("int", "Above the field, over two lines."),
        "below": ("str", "Below the field."),
        "both": ("bool", "Both: above … … and below."),
        "bare": ("float", ""),
    }


def test_toml_types_read_annotations_as_toml_writes_them() -> None:
    assert toml_type('Literal["a", "b"] | None') == '`"a"` | `"b"`'
    assert toml_type("list[str]") == "array of string"
    assert toml_type("tuple[float, float]") == "array of float"
    assert toml_type("dict[str, float]") == "table of float"
    assert toml_type("int | None") == "integer"


def test_a_literal_block_becomes_a_fenced_block() -> None:
    assert docstring("Tables::\n\n    [bus]  ``x``\n    [run]\n\nAfter ``y``.") == (
        "Tables:\n\n```text\n[bus]  ``x``\n[run]\n```\n\nAfter `y`.")


def _tables(cls: type, path: str) -> list[tuple[str, Any]]:
    out = []
    for field in fields(cls):
        name = f"{path}.{field.name}" if path else field.name
        if field.struct is not None:
            out += _tables(field.struct, name)
        else:
            out.append((name, field))
    return out


def test_every_run_config_field_has_a_doc() -> None:
    missing = [name for name, field in _tables(RunConfig, "") if not field.doc and name not in SET_BY_THE_RUN]
    assert not missing, f"config fields without a `#:` doc (the reference page shows them blank): {missing}"


def test_the_generated_reference_pages_are_current() -> None:
    out_of_date = stale(DOCS)
    assert not out_of_date, f"stale generated pages {out_of_date}: run `make docs` (python -m rlbus_tools.docs)"


def test_the_cli_page_does_not_depend_on_the_terminal_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI runs with its own Kafka address and no terminal: the page must come out the same there."""
    monkeypatch.setenv("COLUMNS", "30")
    monkeypatch.setenv("RLBUS_KAFKA_BOOTSTRAP", "10.0.0.1:29092")
    monkeypatch.setenv("RLBUS_REDIS_URL", "redis://10.0.0.1:6390/0")
    assert PAGES["reference/cli.md"]() == (DOCS / "reference" / "cli.md").read_text()


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def test_every_page_under_docs_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert set(PAGES) <= set(nav)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)], capture_output=True, text=True, env=env, timeout=120,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    built = {str(path.relative_to(site)) for path in site.rglob("index.html")}
    for page in _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]):
        stem = page.removesuffix(".md")
        html = "index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html"
        assert html in built, f"{page} was not built"


class _Loads(HTMLParser):
    """What a page makes the browser fetch: scripts, stylesheets, images, frames, fonts."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag in ("script", "img", "iframe", "source") and values.get("src"):
            self.urls.append(str(values["src"]))
        if tag == "link" and values.get("href") and values.get("rel") != "canonical":
            self.urls.append(str(values["href"]))


def _parse(page: Path) -> _Loads:
    parser = _Loads()
    parser.feed(page.read_text())
    return parser


def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    remote = {
        f"{page.relative_to(site)}: {url}"
        for page in site.rglob("*.html") for url in _parse(page).urls if re.match(r"(https?:)?//", url)
    }
    assert not remote, "pages that fetch from the network (the site must work offline):\n" + "\n".join(sorted(remote))


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_readme_resolves(site: Path) -> None:
    broken = []
    for target in _LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            broken.append(target)
        elif anchor:
            page = Path(path).relative_to("docs").with_suffix("")
            html = site / ("index.html" if page.name == "index" else page / "index.html")
            if anchor not in _parse(html).ids:
                broken.append(target)
    assert not broken, f"README links that go nowhere: {broken}"


def test_the_readme_is_a_front_door_with_one_test_command() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    marked = re.findall(r"\*\*The test command is `([^`]+)`\.\*\*", text)
    assert marked == ["make test"], "README must name exactly one test command, the one CI runs"
    target = marked[0].split()[1]
    assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M), f"no `{target}` target in Makefile"


def test_every_generated_page_says_it_is_generated() -> None:
    for name in PAGES:
        assert (DOCS / name).read_text().startswith(GENERATED), name

