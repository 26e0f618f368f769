"""Canonical values: read by exact type without running a method of the value, compared by the launcher with
Python's own semantics for builtins (rlbus/envs/swe/grading/grader_values.py)."""

from __future__ import annotations

import collections
import collections.abc
import decimal
import fractions
from typing import Any, ClassVar

import pytest

from rlbus.envs.swe.grading.grader_values import compare, decode, encoder, opaque

ENCODE = encoder()


@pytest.mark.parametrize(
    "value",
    [None, ..., True, False, 0, -(2**20000), 2.5, float("inf"), -0.0, 1 + 2j, "x\ud800y", b"\x00\xff",
     bytearray(b"ab"), [1, [2, "3"]], (1,), {1: "a", (2, 3): [4]}, {1, 2}, frozenset({3}),
     collections.OrderedDict(b=1, a=2), collections.Counter("aab"), collections.deque([1, 2], 5), range(1, 9, 2),
     decimal.Decimal("1.20"), fractions.Fraction(1, 3), list, type(None)],
    ids=lambda v: type(v).__name__,
)  # fmt: skip
def test_builtin_values_round_trip_exactly(value: Any) -> None:
    form = ENCODE(value)
    assert opaque(form) == []
    back = decode(form)
    assert type(back) is type(value) and back == value
    if isinstance(value, collections.OrderedDict):
        assert list(back) == list(value)  # the order an OrderedDict compares by


class _Spy:
    """Every special method records that it ran."""

    calls: ClassVar[list[str]] = []

    def __eq__(self, other: object) -> bool:
        _Spy.calls.append("__eq__")
        return True

    def __hash__(self) -> int:
        _Spy.calls.append("__hash__")
        return 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _Spy.calls.append("__iter__")
        return iter([])

    def __repr__(self) -> str:
        _Spy.calls.append("__repr__")
        return "spy"

    def __len__(self) -> int:
        _Spy.calls.append("__len__")
        return 0


class _LyingInt(int):
    def __eq__(self, other: object) -> bool:
        _Spy.calls.append("int __eq__")
        return True

    __hash__ = int.__hash__

    def __int__(self) -> int:
        _Spy.calls.append("__int__")
        return 99


class _LyingList(list):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        _Spy.calls.append("list __iter__")
        return iter([7])


class _Meta(type):
    def __eq__(cls, other: object) -> bool:
        _Spy.calls.append("metaclass __eq__")
        return True

    __hash__ = type.__hash__


def test_no_method_of_the_value_runs_and_subclasses_are_their_builtin_value() -> None:
    _Spy.calls.clear()
    spy = _Spy()
    form = ENCODE([spy, {_LyingInt(5): _LyingList([1, 2])}, _Meta("X", (), {})])
    assert _Spy.calls == []
    assert [kind for _, kind in opaque(form)] == ["repo-eq", "repo-eq"]  # the spy, the metaclass'd class
    assert form[1][1] == ["D", [[["I", "0x5"], ["L", [["I", "0x1"], ["I", "0x2"]]]]]]  # what they hold


def test_objects_whose_equality_is_identity_become_tokens_of_the_record() -> None:
    class Plain:
        pass

    a, b = Plain(), Plain()
    left = decode(ENCODE([a, a, b]))
    assert left[0] == left[1] and left[0] != left[2]  # one record: the same object, the same token
    assert compare("==", left[0], left[0]) and not compare("==", left[0], 1)  # never equal to a plain value


def test_trusted_and_test_written_equality_are_named() -> None:
    class Tests:
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__

    import unittest.mock

    class Items(collections.abc.Mapping):  # type: ignore[type-arg]
        __getitem__ = __iter__ = __len__ = None  # type: ignore[assignment]

    trusted = (collections.abc.Mapping, collections.UserDict, type(unittest.mock.ANY))
    ours = encoder(trusted, test_code=lambda code: code is Tests.__eq__.__code__)
    assert opaque(ours(Items())) == [(f"{__name__}.{Items.__qualname__}", "std-eq")]  # Mapping's, on its items
    assert opaque(ours(unittest.mock.ANY)) == [("unittest.mock._ANY", "repo-eq")]  # a wildcard, whoever made it
    assert opaque(ours(Tests()))[0][1] == "test-eq"
    assert opaque(ours(_Spy()))[0][1] == "repo-eq"


def test_limits_and_cycles_are_opaque_not_errors() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    assert [why for _, why in opaque(ENCODE(loop))] == ["recursive"]
    assert [why for _, why in opaque(encoder(max_nodes=10)(list(range(100))))][:1] == ["limit"]
    with pytest.raises(ValueError):
        decode(ENCODE(_Spy()))


@pytest.mark.parametrize(
    ("op", "left", "right", "held"),
    [("==", 1, 1.0, True), ("==", [1, 2], (1, 2), False), ("!=", "a", "b", True), ("<", 1, 2, True),
     ("<", "a", 1, False), ("in", "b", "abc", True), ("not in", 3, [1], True), ("is", None, None, True),
     ("truth", [], None, False), ("falsy", 0, None, True), ("list==", [1], [1], True), ("tuple==", [1], (1,), False),
     ("seq==", [1, 2], (1, 2), True), ("count==", [1, 2, 2], [2, 1, 2], True), ("count==", [1, 2], [2, 2], False),
     ("not:==", 1, 2, True), ("not:<", "a", 1, False), ("approx", 0.1 + 0.2, 0.3, True), ("approx", 1.0, 1.1, False),
     ("approx", [1.0, 2.0], [1.0, 2.0 + 1e-9], True), ("approx", True, 1, False)],
)  # fmt: skip
def test_comparisons_follow_python(op: str, left: Any, right: Any, held: bool) -> None:
    assert compare(op, left, right) is held


def test_approx_tolerances() -> None:
    assert compare("approx", 1.0, 1.1, {"abs": 0.2}) and not compare("approx", 1.0, 1.1, {"abs": 0.01})
    assert compare("approx", 100.0, 101.0, {"rel": 0.02}) and not compare("approx", float("nan"), float("nan"))
    assert compare("approx", float("nan"), float("nan"), {"nan_ok": True})
