"""The ``answer`` environment's documented rule: numeric (commas and spaces removed; integers exactly, decimals
within 1e-6 relative) or exact (whitespace-stripped strings); no answer scores 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.envs.base import make_env
from rlbus.envs.episode import Episode
from rlbus.envs.tasks.answer import parse_number
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt


def prompt(reference: str, match: str) -> Prompt:
    return Prompt(prompt_id="p-1", env="answer", text="How many eggs?", reference=reference,
                  env_config={"match": match})


def answered(answer: str | None, finish: str = "stop") -> Episode:
    return Episode(episode_id="ep-1", token_ids=[], loss_mask=[], logprobs=[], token_versions=[], turns=[],
                   finish_reason=finish, answer=answer)


async def score(answer: str | None, reference: str, match: str) -> float:
    p = prompt(reference, match)
    finish = "stop" if answer is not None else "max_turns"
    reward = await make_env("answer", p.env_config).score(answered(answer, finish), p)
    assert reward.source == "verifier" and reward.reward_id == "ep-1:verifier"
    return reward.value


@pytest.mark.parametrize(
    ("answer", "reference", "match", "value"),
    [
        ("1,234", "1234", "numeric", 1.0),
        ("12", "12.0", "exact", 0.0),
        ("12", "12.0", "numeric", 1.0),
        (None, "12", "numeric", 0.0),
        (None, "12", "exact", 0.0),
        (" 36 ", "36", "exact", 1.0),
        ("36", "36", "exact", 1.0),
        ("Blue", "blue", "exact", 0.0),
        ("1 234", "1,234", "numeric", 1.0),
        ("-7", "-7", "numeric", 1.0),
        ("7", "-7", "numeric", 0.0),
        ("0.3333333", "0.33333333", "numeric", 1.0),  # 1e-7 relative
        ("0.3333", "0.33333333", "numeric", 0.0),  # 1e-4 relative
        ("12345678901234567891", "12345678901234567890", "numeric", 0.0),  # integers compare exactly
        ("36 eggs", "36", "numeric", 0.0),
        ("nan", "1", "numeric", 0.0),
        ("1_000", "1000", "numeric", 0.0),
        # math: symbolic equality by math-verify, the documented examples
        ("0.5", r"\frac{1}{2}", "math", 1.0),
        (r"\frac12", "1/2", "math", 1.0),
        ("2^{1/2}", r"\sqrt{2}", "math", 1.0),
        ("1+x", "x+1", "math", 1.0),
        ("1234", "1,234", "math", 1.0),
        ("0.333", r"\frac{1}{3}", "math", 0.0),  # decimals rounded to 6 places
        ("4", "3", "math", 0.0),
        (r"\boxed{7}", "7", "math", 1.0),
        (None, "7", "math", 0.0),
        ("1" * 1001, "1" * 1001, "math", 0.0),  # past MATH_MAX_CHARS: not parsed
    ],
)
async def test_the_documented_rule(answer: str | None, reference: str, match: str, value: float) -> None:
    assert await score(answer, reference, match) == value


def test_numbers_are_read_after_removing_commas_and_spaces() -> None:
    assert parse_number("1,234") == 1234 and isinstance(parse_number("1,234"), int)
    assert parse_number(" 1 234.5 ") == 1234.5
    assert parse_number("1e3") == 1000.0
    assert [parse_number(t) for t in ("", "abc", "1.2.3", "inf", "1_000", "--1")] == [None] * 6


def test_the_default_is_numeric_and_unknown_rules_name_the_field() -> None:
    env = make_env("answer")
    assert env.config.match == "numeric" and env.config.max_turns == 1
    with pytest.raises(ConfigError) as info:
        make_env("answer", {"match": "fuzzy"})
    assert info.value.field == "env_config.match"


def test_prompts_are_validated_against_the_rule() -> None:
    make_env("answer").validate_prompt(prompt("1,234", "numeric"))
    make_env("answer", {"match": "exact"}).validate_prompt(prompt("blue", "exact"))
    with pytest.raises(ConfigError, match="is not a number"):
        make_env("answer").validate_prompt(prompt("blue", "numeric"))
    with pytest.raises(ConfigError, match="needs a reference"):
        make_env("answer").validate_prompt(Prompt(prompt_id="p", env="answer", text="x"))
    make_env("answer", {"match": "math"}).validate_prompt(prompt(r"\frac{1}{2}", "math"))
    with pytest.raises(ConfigError, match="math-verify cannot parse"):
        make_env("answer", {"match": "math"}).validate_prompt(prompt("}{", "math"))


async def test_math_scores_off_the_main_thread() -> None:
    """The reward worker scores in threads; math-verify's own timeouts (SIGALRM) would fail there."""
    import asyncio

    assert await asyncio.to_thread(lambda: asyncio.run(score("0.5", "1/2", "math"))) == 1.0


async def test_an_episode_through_the_harness_asks_for_the_tag_and_scores_the_answer_in_it() -> None:
    from rlbus.envs.agent import run_episode
    from rlbus.envs.chat import ChatFormat
    from rlbus.envs.scripted import ScriptedEngine

    chat = ChatFormat.for_byte_tokenizer()
    p = prompt("1234", "numeric")
    env = make_env("answer", p.env_config)
    for reply, value in (("Three boxes... <answer>1,234</answer>", 1.0), ("1234", 0.0)):
        engine = ScriptedEngine([reply], tokenizer=chat.tokenizer)
        episode = await run_episode(env, p, engine=engine, chat=chat)
        assert (await env.score(episode, p)).value == value
        system = chat.tokenizer.decode(engine.requests[0].prompt_ids)
        assert "<answer>ANSWER</answer>" in system


def test_the_evaluation_scores_with_the_runs_reward_function_when_it_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rlbus.envs.evaluate.evaluate` with ``scorer``: the accuracy of what RL optimises. A reply without the
    ``<answer>`` tag scores 0 by the environment's rule and 1 by a reward function reading the last number."""
    from types import SimpleNamespace

    import rlbus.engines.torch_stack
    from rlbus.envs.chat import ChatFormat
    from rlbus.envs.evaluate import evaluate
    from rlbus.envs.scripted import ScriptedEngine
    from rlbus.rewards.function import RewardFunction

    chat = ChatFormat.for_byte_tokenizer()

    def replying(*args: object, **kwargs: object) -> SimpleNamespace:  # the engine: it says "It is 36."
        return SimpleNamespace(batching=ScriptedEngine(["It is 36."], tokenizer=chat.tokenizer))

    monkeypatch.setattr(rlbus.engines.torch_stack, "torch_stack", replying)
    p = prompt("36", "numeric")
    assert evaluate(None, [p], chat).accuracy == 0.0  # type: ignore[arg-type]
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "examples" / "wordproblems"))
    scorer = RewardFunction.load("wordproblems:score")
    assert evaluate(None, [p], chat, scorer=scorer).accuracy == 1.0  # type: ignore[arg-type]
