"""The reasoning-gym adapter (``env = "reasoning_gym:NAME"``): prompts drawn from the library's datasets, scored by
the dataset's own ``score_answer`` in the reward worker's way (`env_for` on the prompt the rollout carries)."""

from __future__ import annotations

import msgspec
import pytest

from rlbus.envs.agent import run_episode
from rlbus.envs.base import env_for, make_env
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode
from rlbus.envs.scripted import ScriptedEngine
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt

NAME = "reasoning_gym:basic_arithmetic"
CONFIG = {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"]}}
CHAT = ChatFormat.for_byte_tokenizer()


def answered(answer: str | None) -> Episode:
    return Episode(episode_id="ep-1", token_ids=[], loss_mask=[], logprobs=[], token_versions=[], turns=[],
                   finish_reason="stop" if answer is not None else "max_turns", answer=answer)


def test_prompts_are_the_datasets_entries_and_the_same_for_the_same_seed() -> None:
    import reasoning_gym

    prompts = generate_prompts(NAME, seed=7, n=4, config=CONFIG)
    assert prompts == generate_prompts(NAME, seed=7, n=4, config=CONFIG)
    assert prompts != generate_prompts(NAME, seed=8, n=4, config=CONFIG)
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", seed=7, size=4, **CONFIG["config"]))
    assert [p.text for p in prompts] == [e["question"] for e in entries]
    assert [p.reference for p in prompts] == [str(e["answer"]) for e in entries]
    assert {p.env for p in prompts} == {NAME} and prompts[2].metadata["reasoning_gym.index"] == "2"
    assert prompts[0].env_config["dataset"] == "basic_arithmetic"


@pytest.mark.parametrize("wire", [False, True])
async def test_the_datasets_own_grader_scores_the_answer(wire: bool) -> None:
    prompt = generate_prompts(NAME, seed=3, n=2, config=CONFIG)[1]
    if wire:  # as the reward worker sees it: decoded from the rollout's bytes
        prompt = msgspec.json.decode(msgspec.json.encode(prompt), type=Prompt)
    env = env_for(prompt)
    right = await env.score(answered(prompt.reference), prompt)
    assert (right.value, right.source, right.components) == (1.0, "verifier", {"reasoning_gym": 1.0})
    assert right.metadata["grader"] == NAME
    assert (await env.score(answered("not a number"), prompt)).value == 0.0
    assert (await env.score(answered(None), prompt)).reason.startswith("no answer")


async def test_partial_credit_is_the_datasets() -> None:
    """``score_answer`` is the library's: a dataset with partial credit keeps it (here: an answer containing
    the oracle answer scores len(oracle) / len(answer), the base class's rule)."""
    prompt = generate_prompts("reasoning_gym:gcd", seed=1, n=1, config={})[0]
    assert prompt.reference is not None
    value = (await env_for(prompt).score(answered(f"{prompt.reference}!!"), prompt)).value
    assert value == pytest.approx(len(prompt.reference) / (len(prompt.reference) + 2))


async def test_a_reference_episode_through_the_harness_scores_one() -> None:
    prompt = generate_prompts(NAME, seed=5, n=1, config=CONFIG)[0]
    env = env_for(prompt)
    engine = ScriptedEngine(env.reference_turns(prompt), tokenizer=CHAT.tokenizer)  # type: ignore[attr-defined]
    episode = await run_episode(env, prompt, engine=engine, chat=CHAT)
    assert episode.answer == prompt.reference and (await env.score(episode, prompt)).value == 1.0


async def test_a_prompt_that_is_not_its_entry_is_refused() -> None:
    prompt = generate_prompts(NAME, seed=3, n=2, config=CONFIG)[0]
    forged = msgspec.structs.replace(prompt, text="Calculate 1 + 1.")
    with pytest.raises(ValueError, match="is another question"):
        await env_for(forged).score(answered("2"), forged)
    bare = msgspec.structs.replace(prompt, metadata={})
    with pytest.raises(ValueError, match="does not locate"):
        await env_for(bare).score(answered("2"), bare)


@pytest.mark.parametrize(
    ("name", "config", "field", "says"),
    [
        ("reasoning_gym:basic_arithmetc", {}, "env_config.dataset", "did you mean `basic_arithmetic`"),
        (NAME, {"config": {"min_term": 2}}, "env_config.config.min_term", "did you mean `min_terms`"),
        (NAME, {"config": {"seed": 1}}, "env_config.config.seed", "set by rlbus"),
        (NAME, {"config": {"min_terms": 0}}, "env_config.config", "min_terms must be positive"),
        (NAME, {"dataset": "chain_sum"}, "env_config.dataset", "contradicts"),
        ("reasoning_gym:", {}, "env", "names no dataset"),
        ("reasoning_gym", {}, "env_config.dataset", "unknown reasoning-gym dataset ''"),
    ],
)
def test_a_bad_config_names_its_field(name: str, config: dict[str, object], field: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_env(name, config)
    assert info.value.field == field and says in info.value.problem


def test_config_check_builds_it(tmp_path: object) -> None:
    from pathlib import Path

    from rlbus.launch.check import check_config

    path = Path(str(tmp_path)) / "run.toml"
    path.write_text(f'[task]\nenv = "{NAME}"\nenv_config = {{ instructions = false, max_new_tokens = 16, config = '
                    '{ min_terms = 2, max_terms = 2, max_digits = 1 } }\n')
    notes = check_config(path, {}).notes
    assert any(NAME in note and "generates prompts" in note for note in notes), notes
