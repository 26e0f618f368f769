"""The problem bank of the ``python_fn`` task: each function here is the reference solution of one problem.

The source of each function (``inspect.getsource``) is the reference answer shown in warm-start data, and
calling it in the worker computes the hidden tests' expected values, so a problem is written once.
Inputs come from a seeded generator per problem; every value is JSON (tests travel in ``env_config``).
"""

from __future__ import annotations

import inspect
import random
import string
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def add(a: int, b: int) -> int:
    return a + b


def max_of(xs: list[int]) -> int:
    best = xs[0]
    for x in xs:
        if x > best:
            best = x
    return best


def count_vowels(s: str) -> int:
    return sum(1 for c in s if c in "aeiou")


def reverse_words(s: str) -> str:
    return " ".join(reversed(s.split(" ")))


def is_palindrome(s: str) -> bool:
    return s == s[::-1]


def sum_even(xs: list[int]) -> int:
    return sum(x for x in xs if x % 2 == 0)


def fizzbuzz(n: int) -> str:
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)


def dedupe(xs: list[int]) -> list[int]:
    seen: list[int] = []
    for x in xs:
        if x not in seen:
            seen.append(x)
    return seen


@dataclass(frozen=True)
class Problem:
    """A function to write: its signature, what it does, a reference, and an input generator."""

    signature: str
    description: str
    solution: Callable[..., Any]
    make_args: Callable[[random.Random], list[Any]]

    @property
    def name(self) -> str:
        return self.solution.__name__

    @property
    def source(self) -> str:
        return textwrap.dedent(inspect.getsource(self.solution))


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n: tuple[int, int] = (1, 6)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random, n: tuple[int, int] = (1, 8)) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(*n)))


def _palindrome_candidate(rng: random.Random) -> str:
    half = _word(rng, (1, 4))
    return half + half[::-1][rng.randint(0, 1) :] if rng.random() < 0.5 else _word(rng, (2, 6))


PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in (
        Problem("add(a, b)", "returns the sum of the integers a and b", add,
                lambda r: [r.randint(-99, 99), r.randint(-99, 99)]),
        Problem("max_of(xs)", "returns the largest number in the non-empty list xs", max_of,
                lambda r: [_ints(r)]),
        Problem("count_vowels(s)", "returns how many of the characters of the lowercase string s are vowels"
                " (a, e, i, o, u)", count_vowels, lambda r: [_word(r)]),
        Problem("reverse_words(s)", "returns s with its space-separated words in reverse order", reverse_words,
                lambda r: [" ".join(_word(r, (1, 5)) for _ in range(r.randint(1, 4)))]),
        Problem("is_palindrome(s)", "returns True if the string s reads the same backwards, else False",
                is_palindrome, lambda r: [_palindrome_candidate(r)]),
        Problem("sum_even(xs)", "returns the sum of the even integers in the list xs", sum_even,
                lambda r: [_ints(r, n=(0, 6))]),
        Problem("fizzbuzz(n)", 'returns "FizzBuzz" if n is divisible by 15, "Fizz" if by 3, "Buzz" if by 5,'
                " else str(n)", fizzbuzz, lambda r: [r.randint(1, 100)]),
        Problem("dedupe(xs)", "returns the list xs without repeated elements, keeping first occurrences in"
                " order", dedupe, lambda r: [_ints(r, 0, 5, (0, 7))]),
    )
}  # fmt: skip
