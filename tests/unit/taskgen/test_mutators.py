"""The bug kinds on small functions: each kind's rewrite, seeded determinism, and the reverse patch."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from rlbus.taskgen import mutators, patches

SAMPLE = '''\
def f(items, n, flag=True):
    """Docstring: 1 < 2 is not a site."""
    if n < 0:
        return None
    total = 0
    for i in range(1, n):
        if items[i] in (3, 4) and flag:
            total = total + items[i - 1]
    while not items:
        break
    return max(total, n), items[:n]
'''


def _function(source: str) -> ast.FunctionDef:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def _rewrites(kind: str, source: str = SAMPLE) -> list[str]:
    found = mutators.sites(source, _function(source)).get(kind, [])
    return [m.apply(source) for m in found]


def _changed_lines(old: str, new: str) -> list[tuple[str, str]]:
    pairs = zip(old.splitlines(), new.splitlines(), strict=False)
    return [(a.strip(), b.strip()) for a, b in pairs if a != b]


def test_every_kind_has_sites_in_the_sample() -> None:
    assert set(mutators.sites(SAMPLE, _function(SAMPLE))) == set(mutators.KINDS)


def test_flip_comparison_rewrites_only_the_operator() -> None:
    changes = [_changed_lines(SAMPLE, new) for new in _rewrites("flip_comparison")]
    assert [("if n < 0:", "if n <= 0:")] in changes
    assert [("if items[i] in (3, 4) and flag:", "if items[i] not in (3, 4) and flag:")] in changes
    assert all("Docstring" not in a for change in changes for a, _ in change)


def test_invert_condition_wraps_and_unwraps() -> None:
    changes = [_changed_lines(SAMPLE, new) for new in _rewrites("invert_condition")]
    assert [("if n < 0:", "if not (n < 0):")] in changes
    assert [("while not items:", "while items:")] in changes
    atom = "def g(flag):\n    return 1 if flag else 2\n"
    assert _rewrites("invert_condition", atom) == [atom.replace("if flag", "if not flag")]


def test_off_by_one_in_range_and_slices() -> None:
    changes = [_changed_lines(SAMPLE, new) for new in _rewrites("off_by_one")]
    assert [("for i in range(1, n):", "for i in range(2, n):")] in changes
    assert [("for i in range(1, n):", "for i in range(0, n):")] in changes
    assert [("return max(total, n), items[:n]", "return max(total, n), items[:n + 1]")] in changes


def test_swap_arguments_swaps_the_first_two() -> None:
    changes = [_changed_lines(SAMPLE, new) for new in _rewrites("swap_arguments")]
    assert [("for i in range(1, n):", "for i in range(n, 1):")] in changes
    assert [("return max(total, n), items[:n]", "return max(n, total), items[:n]")] in changes


def test_drop_guard_deletes_an_early_exit() -> None:
    (dropped,) = _rewrites("drop_guard")
    assert "if n < 0:" not in dropped and "return None" not in dropped
    assert len(dropped.splitlines()) == len(SAMPLE.splitlines()) - 2


def test_change_constant_outside_indexing_and_booleans() -> None:
    changes = [_changed_lines(SAMPLE, new) for new in _rewrites("change_constant")]
    assert [("total = 0", "total = 1")] in changes
    assert [("if items[i] in (3, 4) and flag:", "if items[i] in (4, 4) and flag:")] in changes
    assert [("def f(items, n, flag=True):", "def f(items, n, flag=False):")] not in changes  # signature
    assert all("range(" not in a for change in changes for a, _ in change)  # range() is off_by_one's


def test_swap_operator_arithmetic_and_boolean() -> None:
    changes = [_changed_lines(SAMPLE, new) for new in _rewrites("swap_operator")]
    assert [("total = total + items[i - 1]", "total = total - items[i - 1]")] in changes
    assert [("total = total + items[i - 1]", "total = total + items[i + 1]")] in changes
    assert [("if items[i] in (3, 4) and flag:", "if items[i] in (3, 4) or flag:")] in changes


def test_every_rewrite_parses_and_changes_the_ast() -> None:
    original = ast.dump(ast.parse(SAMPLE))
    for kind in mutators.KINDS:
        for new in _rewrites(kind):
            assert ast.dump(ast.parse(new)) != original, kind


def test_the_same_seed_picks_the_same_mutations() -> None:
    def picks(seed: int) -> list[mutators.Mutation | None]:
        rng = random.Random(seed)
        return [mutators.choose(SAMPLE, _function(SAMPLE), rng, tried=set()) for _ in range(12)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)


def test_choose_skips_tried_sites_and_runs_out() -> None:
    rng = random.Random(0)
    function = _function(SAMPLE)
    tried: set[mutators.Mutation] = set()
    total = sum(len(ms) for ms in mutators.sites(SAMPLE, function).values())
    for _ in range(total):
        mutation = mutators.choose(SAMPLE, function, rng, tried=tried)
        assert mutation is not None and mutation not in tried
        tried.add(mutation)
    assert mutators.choose(SAMPLE, function, rng, tried=tried) is None


def test_find_function_by_first_line_with_decorators() -> None:
    source = "import functools\n\n@functools.cache\ndef g(x):\n    return x + 1\n"
    tree = ast.parse(source)
    assert mutators.find_function(tree, 3, "g") is not None  # a code object's firstlineno is the decorator's
    assert mutators.find_function(tree, 4, "g") is not None
    assert mutators.find_function(tree, 5, "g") is None


def test_non_ascii_source_keeps_offsets_right() -> None:
    source = 'def h(s):\n    if s == "é€":\n        return 1\n    return 2\n'
    (flipped,) = _rewrites("flip_comparison", source)
    assert flipped == source.replace("==", "!=")


@pytest.mark.parametrize("kind", mutators.KINDS)
def test_the_solution_patch_restores_the_original(kind: str, tmp_path: Path) -> None:
    mutated = _rewrites(kind)[0]
    (tmp_path / "pkg").mkdir()
    target = tmp_path / "pkg" / "mod.py"
    target.write_text(SAMPLE)
    bug = patches.diff("pkg/mod.py", SAMPLE, mutated)
    patches.apply(tmp_path, bug)
    assert target.read_text() == mutated
    patches.apply(tmp_path, patches.diff("pkg/mod.py", mutated, SAMPLE))
    assert target.read_text() == SAMPLE
    assert bug.startswith("diff --git a/pkg/mod.py b/pkg/mod.py\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n")
