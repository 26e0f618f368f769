"""Splitting the hidden tests: what the test process sees has no answer in it, and every assertion becomes a
report the launcher can check (rlbus/envs/swe/grading/split.py)."""

from __future__ import annotations

import types
import warnings
from typing import Any

from rlbus.envs.swe.grading.grader_values import decode
from rlbus.envs.swe.grading.split import CHECK, OBJ, REG, SLOT, split_tests

TESTS = '''
import pytest
from calc import add, table
from helpers import assert_equal, raises


def test_literals():
    assert add(2, 3) == 5
    assert -7 == add(-3, -4)
    assert add(1, 1) != 31


def test_answer_local(x):
    expected = "\\n".join(["a  1", "bb 22"])
    result = table(x)
    assert_equal(expected, result)


def test_input_local():
    words = ["alpha", "beta"]
    assert add(*words) == "alphabeta"
    assert words[0] in add("alpha", "z")


def test_forms(value):
    assert value is None
    assert not (add(1, 2) == 4)
    assert add(0.1, 0.2) == pytest.approx(0.3, abs=1e-9)
    assert value and add(1, 1)
    with pytest.raises(TypeError):
        add(1, "x")
    if value:
        return
    assert add(9, 9) == 18
'''
HELPERS = '''
from pytest import raises


def assert_equal(expected, result):
    print("expected", expected)
    assert expected == result
'''
SPLIT = split_tests({"tests/test_calc.py": TESTS.encode(), "tests/helpers.py": HELPERS.encode()})
VISIBLE = SPLIT.visible["tests/test_calc.py"]


def _code(source: str) -> types.CodeType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile(source, "t.py", "exec")


def _constants(code: types.CodeType) -> list[Any]:
    out: list[Any] = []
    for c in code.co_consts:
        out += _constants(c) if isinstance(c, types.CodeType) else [c]
    return out


def test_answers_are_not_in_the_visible_code_nor_its_constants() -> None:
    constants = _constants(_code(VISIBLE))
    for answer in (5, -7, 18, "a  1\nbb 22", 0.3):
        assert answer not in constants, answer
    assert 31 in constants and 4 in constants  # what a value must not be (!=, not ==) is no answer
    assert "a  1" not in VISIBLE and "0.3" not in VISIBLE and "18" not in VISIBLE
    held = {decode(form) for slot in SPLIT.slots.values() for form in slot.answers.values() if slot.op != "approx"}
    assert {5, -7, 18, "a  1\nbb 22", None} <= held


def test_inputs_stay_and_each_assertion_reports_its_computed_operands() -> None:
    assert "add(2, 3)" in VISIBLE and "table(x)" in VISIBLE and "['alpha', 'beta']" in VISIBLE
    assert "expected" not in VISIBLE.split("def test_answer_local")[1].split("def ")[0]  # the local is gone
    assert "assert " not in VISIBLE and VISIBLE.count(repr(CHECK)) == len(SPLIT.slots) - len(
        [s for s in SPLIT.slots.values() if s.path == "tests/helpers.py"])  # fmt: skip
    ops = [(s.op, s.layout) for s in SPLIT.slots.values() if s.path == "tests/test_calc.py"]
    assert ops == [("==", "ca"), ("==", "ac"), ("!=", "cc"), ("==", "ac"), ("==", "ca"), ("in", "cc"),
                   ("is", "ca"), ("not:==", "cc"), ("approx", "c~"), ("truth", "c"), ("truth", "c"),
                   ("==", "ca")]  # fmt: skip
    approx = next(s for s in SPLIT.slots.values() if s.op == "approx")
    assert approx.tolerance == {"abs": 1e-9} and decode(approx.answers[1]) == 0.3


def test_mandatory_slots_are_those_before_anything_that_can_leave() -> None:
    lines = TESTS.splitlines()
    by_line = {lines[s.line - 1].strip(): s.mandatory for s in SPLIT.slots.values() if s.path == "tests/test_calc.py"}
    assert by_line["assert add(2, 3) == 5"] and by_line["assert add(1, 1) != 31"]
    assert by_line["assert value is None"] and by_line["assert value and add(1, 1)"]  # before the with block
    assert not by_line["assert add(9, 9) == 18"]  # after `with pytest.raises` and an early return


def test_trusted_names_and_definitions_are_constants() -> None:
    assert repr(f"{OBJ}pytest:raises") in VISIBLE and "pytest:approx" not in VISIBLE  # approx: held aside
    assert VISIBLE.count(repr(REG)) == 4  # each test function passes through REG
    assert repr(f"{SLOT}2") in VISIBLE
    helpers = SPLIT.visible["tests/helpers.py"]
    assert "print" in helpers and repr(CHECK) in helpers  # the helper itself still reports, when called


def test_comparison_classes_of_the_tests_keep_the_operands_in_process() -> None:
    source = b'''
class Loose(dict):
    def __eq__(self, other):
        return isinstance(other, Loose) and dict.__eq__(self, other)


def test_loose():
    assert not (Loose(a=1) == {"a": 1})


def test_other():
    assert len("ab") == 2
'''
    split = split_tests({"tests/test_l.py": source})
    layouts = [s.layout for s in split.slots.values()]
    assert layouts == ["cc", "aa"] and "{'a': 1}" in split.visible["tests/test_l.py"]


def test_unparsable_files_are_left_as_they_are() -> None:
    split = split_tests({"tests/test_bad.py": b"def test(:\n"})
    assert split.untouched == ["tests/test_bad.py"] and split.visible["tests/test_bad.py"] == "def test(:\n"


PARAMETRIZED = b'''
import pytest
from lib import plural

PAIRS = (("box", "boxes"), ("ox", "oxen"), ("ox", "oxen"))


@pytest.mark.parametrize(("word", "expected"), PAIRS)
def test_plural(word, expected):
    assert plural(word) == expected
    assert plural(word.upper()) == expected.upper()


@pytest.mark.parametrize("n", [1, 2])
def test_input_only(n):
    assert plural(str(n)) == "ns"
'''


def test_a_parametrisations_answer_column_is_held_aside_and_its_cases_renamed() -> None:
    tests = ["tests/test_p.py::test_plural[box-boxes]", "tests/test_p.py::test_plural[ox-oxen0]",
             "tests/test_p.py::test_input_only"]  # fmt: skip
    split = split_tests({"tests/test_p.py": PARAMETRIZED}, tests, seed=0)
    visible = split.visible["tests/test_p.py"]
    assert "boxes" not in visible and "oxen" not in visible and "PAIRS = None" in visible  # the table is gone
    assert "'box', None" in visible and "ids=['c0', 'c1', 'c2']" in visible
    assert sorted(split.renamed) == sorted(["tests/test_p.py::test_plural[box-boxes]",
                                            "tests/test_p.py::test_plural[ox-oxen0]",
                                            "tests/test_p.py::test_plural[ox-oxen1]"])  # fmt: skip
    box = split.renamed["tests/test_p.py::test_plural[box-boxes]"].split("[")[1][:-1]
    first, upper = (s for s in split.slots.values() if s.line in (10, 11))
    assert decode(first.cases[box][1]) == "boxes" and decode(upper.cases[box][1]) == "BOXES"
    assert first.answers == {}
    assert "[1, 2]" in visible  # n is an input: that table stays as written


def test_a_parametrisation_whose_ids_do_not_match_the_task_is_left_as_written() -> None:
    split = split_tests({"tests/test_p.py": PARAMETRIZED}, ["tests/test_p.py::test_plural[what-ever]"])
    assert split.renamed == {} and "'boxes'" in split.visible["tests/test_p.py"]
