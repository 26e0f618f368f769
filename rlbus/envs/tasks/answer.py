"""``answer``: a one-turn environment for a user's own problems, scored against each prompt's ``reference``.

It generates nothing: its prompts come from a JSONL file (`rlbus.envs.tasks.jsonl`, ``[task] prompts``), each
line carrying the problem as ``text`` and the expected answer as ``reference``. The model sees a system
message asking for ``<answer>ANSWER</answer>`` (turn it off with ``"instructions": false``) and the reward is
the verifier's, by this rule (``env_config = {"match": ...}``):

``numeric`` (the default)
    The final answer and the reference are read as numbers after removing every comma and every whitespace
    character (``"1,234"`` and ``" 1 234 "`` are 1234). Two integers (``[+-]?digits``) must be equal; otherwise
    both are read as decimals (``12``, ``12.0``, ``-0.5``, ``1e3``) and must agree within 1e-6 relative
    (`math.isclose` with ``rel_tol=1e-6``). An answer that is not a number scores 0. The reference must be a
    number: a line whose reference is not fails validation, naming the file and line.
``exact``
    The final answer equals the reference after stripping surrounding whitespace (``"12"`` is not ``"12.0"``;
    case and inner spacing matter), like the built-in tasks' verifiers (`rlbus.envs.scoring.exact_match`).
``math``
    Both are parsed as math by Hugging Face's ``math-verify`` (``pip install 'rlbus[envs]'``) and compared
    symbolically: ``\\frac{1}{2}`` matches ``0.5`` and ``1/2``, ``\\sqrt{2}`` matches ``2^{1/2}``, ``x+1``
    matches ``1+x``, ``1,234`` matches ``1234``; decimals are compared rounded to 6 places, so ``0.333`` does
    not match ``\\frac{1}{3}``. Text without ``$`` or ``\\boxed`` is read as LaTeX math (it is wrapped in
    ``$…$``). The reference must parse: a line whose reference does not fails validation. Answers longer than
    `MATH_MAX_CHARS` score 0 unparsed (sympy has no time limit here: math-verify's own uses SIGALRM,
    which works only on a main thread, and the reward worker scores on others).

An episode that ends without an answer (no ``<answer>`` tag: ``max_turns`` or ``length``) scores 0 with
the finish reason recorded. Every line needs a ``reference``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from rlbus.envs.base import Environment, HarnessConfig, register_env
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import exact_match, make_reward
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt, Reward

_INTEGER = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_IGNORED = re.compile(r"[,\s]")

#: Relative tolerance of a decimal comparison under ``match = "numeric"``.
REL_TOL = 1e-6
#: Under ``match = "math"``, a longer answer scores 0 without being parsed.
MATH_MAX_CHARS = 1000


class AnswerConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How answers are compared; the harness fields are the defaults of every environment (one turn)."""

    match: Literal["exact", "numeric", "math"] = "numeric"
    """``numeric``: as numbers (commas and spaces removed; integers exactly, decimals within 1e-6 relative);
    ``exact``: whitespace-stripped string equality; ``math``: symbolic equality by math-verify."""


def parse_number(text: str) -> int | float | None:
    """``text`` as a number after removing commas and whitespace: an int for ``[+-]?digits``, a finite float
    for a decimal, None for anything else."""
    cleaned = _IGNORED.sub("", text)
    if _INTEGER.fullmatch(cleaned):
        return int(cleaned)
    if _DECIMAL.fullmatch(cleaned):
        value = float(cleaned)
        return value if math.isfinite(value) else None
    return None


def numbers_match(answer: int | float, reference: int | float) -> bool:
    if isinstance(answer, int) and isinstance(reference, int):
        return answer == reference
    return math.isclose(answer, reference, rel_tol=REL_TOL)


def parse_math(text: str) -> list[Any]:
    """``text`` parsed by math-verify (``$…$`` added when it has no ``$`` or ``\\boxed``): sympy objects and the
    matched text; only strings (or []) when no math parses. No timeout (see the module docstring): callers bound
    the length."""
    from math_verify import parse

    text = text.strip()
    parsed: list[Any] = parse(text if "$" in text or "\\boxed" in text else f"${text}$", parsing_timeout=None)
    return parsed


def math_match(answer: str, reference: str) -> bool:
    from math_verify import verify

    if len(answer) > MATH_MAX_CHARS:
        return False
    gold, got = parse_math(reference), parse_math(answer)
    return bool(gold and got and verify(gold, got, timeout_seconds=None))


class AnswerEnv(Environment[AnswerConfig]):
    config_type = AnswerConfig

    def __init__(self, config: AnswerConfig) -> None:
        super().__init__(config)
        if config.match == "math":
            try:
                import math_verify  # noqa: F401
            except ImportError:
                raise ConfigError("env_config.match", "\"math\" needs the math-verify package: pip install "
                                  "'rlbus[envs]' (or pip install math-verify)") from None

    def validate_prompt(self, prompt: Prompt) -> None:
        if prompt.reference is None:
            raise ConfigError("reference", "the answer environment needs a reference answer on every prompt")
        if self.config.match == "math" and all(isinstance(x, str) for x in parse_math(prompt.reference)):
            raise ConfigError("reference", f"math-verify cannot parse {prompt.reference!r} (match = \"math\")")
        if self.config.match == "numeric" and parse_number(prompt.reference) is None:
            raise ConfigError("reference", f"{prompt.reference!r} is not a number (match = \"numeric\"); "
                              "use env_config {\"match\": \"exact\"} for other answers")

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        if self.config.match == "exact":
            return exact_match(episode, prompt)
        if self.config.match == "math":
            return self._math(episode, prompt)
        if prompt.reference is None:
            raise ValueError(f"prompt {prompt.prompt_id} has no reference answer to match")
        expected = parse_number(prompt.reference)
        if expected is None:
            raise ValueError(f"prompt {prompt.prompt_id}: reference {prompt.reference!r} is not a number")
        if episode.answer is None:
            reason = f"no answer (episode ended with {episode.finish_reason!r})"
            return make_reward(episode, prompt, source="verifier", value=0.0, reason=reason,
                               components={"numeric": 0.0})
        got = parse_number(episode.answer)
        ok = got is not None and numbers_match(got, expected)
        if ok:
            reason = "numeric match"
        elif got is None:
            reason = f"not a number: {episode.answer[:200]!r}"
        else:
            reason = f"expected {prompt.reference!r}, got {episode.answer[:200]!r}"
        value = 1.0 if ok else 0.0
        return make_reward(episode, prompt, source="verifier", value=value, reason=reason,
                           components={"numeric": value})

    def _math(self, episode: Episode, prompt: Prompt) -> Reward:
        if prompt.reference is None:
            raise ValueError(f"prompt {prompt.prompt_id} has no reference answer to match")
        if episode.answer is None:
            reason = f"no answer (episode ended with {episode.finish_reason!r})"
            return make_reward(episode, prompt, source="verifier", value=0.0, reason=reason,
                               components={"math": 0.0})
        ok = math_match(episode.answer, prompt.reference)
        reason = "math-verify: equal" if ok else f"math-verify: {episode.answer[:200]!r} is not {prompt.reference!r}"
        value = 1.0 if ok else 0.0
        return make_reward(episode, prompt, source="verifier", value=value, reason=reason, components={"math": value})


register_env("answer", AnswerEnv)
