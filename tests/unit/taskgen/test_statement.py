"""The issue text: evidence from the failure, never the changed line, and the same text every run."""

from __future__ import annotations

from rlbus.taskgen import statement

ERROR = {
    "type": "AssertionError",
    "message": "assert <pkg.Thing object at 0x7fd8603bda10> == 3\n  where x = total = total - items[i - 1]",
    "frames": [
        ["/sandbox/repo/tests/test_pkg.py", 10, "test_total"],
        ["/sandbox/repo/src/pkg/core.py", 20, "total"],
        ["/sandbox/repo/src/pkg/core.py", 30, "_helper"],
    ],
}


def test_summary_drops_the_mutated_line_and_addresses() -> None:
    text = statement.summarise(ERROR, hidden=["    total = total - items[i - 1]"])
    assert text == "AssertionError: assert <pkg.Thing object at 0x…> == 3"


def test_long_messages_are_cut() -> None:
    long = {"type": "ValueError", "message": "\n".join(f"line {i}" for i in range(40))}
    text = statement.summarise(long)
    assert text.count("\n") == 14 and text.endswith("…")


def test_call_chain_names_library_functions_only() -> None:
    chain = statement.call_chain(ERROR, package_files=["src/pkg/core.py", "src/pkg/__init__.py"])
    assert chain == ["pkg.core.total", "pkg.core._helper"]


def test_issue_lists_failures_and_quotes_ids_for_the_shell() -> None:
    text = statement.write(
        library="pkg", version="1.0", failing=["tests/test_pkg.py::test_total[1-2]"], first_error=ERROR,
        chain=["pkg.core.total"], hidden=["total = total - items[i - 1]"], command="python -m pytest -q {tests}",
    )  # fmt: skip
    assert text.startswith("# Wrong behaviour in `pkg.core.total`")
    assert "python -m pytest -q 'tests/test_pkg.py::test_total[1-2]'" in text
    assert "total - items" not in text and "0x7fd8" not in text
