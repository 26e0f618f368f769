"""A user's environment and reward function reach every process by name: an import path (``mod:Class``,
``mod:function``) or an ``rlbus.envs`` entry point, resolved where environments are made (`make_env`) and
where the reward worker is built; every failure names the field and says what failed."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.dlq import read_dead_letters
from rlbus.bus.topics import ROLLOUTS, topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.envs import base
from rlbus.envs.base import env_for, make_env, registered_envs
from rlbus.envs.chat import ChatFormat, format_answer
from rlbus.envs.episode import Episode, episode_to_rollout
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import ConfigError, RewardFunctionError
from rlbus.launch.config import config_from_dict
from rlbus.rewards.function import RewardFunction
from rlbus.rewards.verifier import VerifierScorer
from rlbus.schemas import Prompt

CHAT = ChatFormat.for_byte_tokenizer()

PLUGIN = '''
import asyncio
from rlbus.envs import Task
from rlbus.envs.tasks.arith import ArithTask

class Mine(ArithTask):
    pass

class Half(Task):  # no generate, reference_turns or score
    pass

def score(prompt, completion, reference):
    return 1.0 if completion.strip().endswith(f"<answer>{reference}</answer>") else 0.0

async def ascore(prompt, completion, reference):
    await asyncio.sleep(0)
    return 0.5

def boom(prompt, completion, reference):
    raise KeyError("no such thing")

def nan(prompt, completion, reference):
    return float("nan")

def text(prompt, completion, reference):
    return "7"

def two(prompt, completion):
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module ``userplug_<n>`` importable from a directory on sys.path (as PYTHONPATH would put it)."""
    name = f"userplug_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    for key in [k for k in base._LOADED if k.startswith(name)]:
        del base._LOADED[key]


def test_an_environment_by_import_path_is_made_and_names_its_prompts(plugin: str) -> None:
    env = make_env(f"{plugin}:Mine", {"digits": 1})
    assert type(env).__name__ == "Mine" and env.config.digits == 1
    prompts = generate_prompts(f"{plugin}:Mine", seed=0, n=3, config={"digits": 1})
    # the class generates prompts naming "arith"; they carry the name it was configured under, so the rollout and
    # reward workers that receive them make the same environment
    assert {p.env for p in prompts} == {f"{plugin}:Mine"}
    assert type(base.env_for(prompts[0])).__name__ == "Mine"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("no_such_pkg_xyz.tasks:Env", ["cannot import module 'no_such_pkg_xyz.tasks'", "pip install", "PYTHONPATH"]),
        ("{plugin}:Mien", ["has no attribute 'Mien'", "did you mean `Mine`?"]),
        ("{plugin}:score", ["is a function, not an environment class"]),
        ("{plugin}:NOT_CALLABLE", ["is a int, not an environment class"]),
        ("rlbus.schemas:Prompt", ["the class Prompt, not an environment class"]),
        ("{plugin}:Half", ["is abstract: it does not implement generate, reference_turns, score"]),
        ("arihh", ["unknown environment 'arihh'", "did you mean `arith`?", "package.module:Class"]),
    ],
)
def test_an_environment_that_cannot_be_made_names_env_and_what_failed(plugin: str, name: str, says: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        make_env(name.format(plugin=plugin), {})
    assert info.value.field == "env"
    for text in says:
        assert text in info.value.problem


def test_an_entry_point_names_an_environment_loaded_on_first_use(plugin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    points = [EntryPoint(name="mine", value=f"{plugin}:Mine", group="rlbus.envs"),
              EntryPoint(name="broken", value="no_such_pkg_xyz:Env", group="rlbus.envs")]  # fmt: skip
    monkeypatch.setattr(base, "entry_points", lambda group: [p for p in points if p.group == group])
    monkeypatch.delitem(base._LOADED, "mine", raising=False)
    assert {"mine", "broken", "arith"} <= set(registered_envs())
    assert plugin not in sys.modules  # listed, not loaded
    assert type(make_env("mine", {})).__name__ == "Mine"
    assert {p.env for p in generate_prompts("mine", seed=1, n=2)} == {"mine"}
    with pytest.raises(ConfigError) as info:
        make_env("broken", {})
    assert info.value.field == "env" and "entry point 'broken'" in info.value.problem
    base._LOADED.pop("mine", None)


@pytest.mark.parametrize(
    ("attr", "says"),
    [
        ("NOT_CALLABLE", "not a function score(prompt, completion, reference)"),
        ("Mine", "the class Mine, not a function"),
        ("two", "cannot be called as score(prompt, completion, reference)"),
        ("nope", "has no attribute 'nope'"),
    ],
)
def test_a_reward_function_is_checked_when_the_config_loads(plugin: str, attr: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"reward": {"function": f"{plugin}:{attr}"}}, {})
    assert info.value.field == "reward.function" and says in info.value.problem


def test_a_reward_function_needs_the_verifier_kind(plugin: str) -> None:
    rubric = str(Path(__file__).parents[3] / "infra" / "rlbus" / "rubrics" / "answer.toml")
    with pytest.raises(ConfigError) as info:
        config_from_dict({"reward": {"kind": "judge", "function": f"{plugin}:score", "judge": {"rubric": rubric}}}, {})
    assert info.value.field == "reward.function"
    config = config_from_dict({"reward": {"function": f"{plugin}:score"}}, {})
    assert config.reward.function == f"{plugin}:score"
    assert "verifier" in config.trainer.reward_sources  # the default joins the function's rewards


async def played(prompt: Prompt, answer: str) -> Episode:
    """The episode of a model that answers ``answer``, played through the real harness."""
    from rlbus.envs.agent import run_episode
    from rlbus.envs.scripted import ScriptedEngine

    engine = ScriptedEngine([format_answer(answer)], tokenizer=CHAT.tokenizer)
    episode_id = f"{prompt.prompt_id}-{answer}"
    return await run_episode(env_for(prompt), prompt, engine=engine, chat=CHAT, episode_id=episode_id)


async def test_a_reward_function_scores_sync_or_async_and_refuses_bad_values(plugin: str) -> None:
    [prompt] = generate_prompts("arith", seed=0, n=1)
    right, wrong = await played(prompt, str(prompt.reference)), await played(prompt, "x")
    function = RewardFunction.load(f"{plugin}:score")
    reward = await function.score(right, prompt)
    assert (reward.value, reward.source, reward.metadata) == (1.0, "verifier", {"function": f"{plugin}:score"})
    assert (await function.score(wrong, prompt)).value == 0.0
    assert (await RewardFunction.load(f"{plugin}:ascore").score(right, prompt)).value == 0.5
    for attr, says in [("boom", "raised KeyError"), ("nan", "returned nan"), ("text", "not a number")]:
        with pytest.raises(RewardFunctionError, match=says):
            await RewardFunction.load(f"{plugin}:{attr}").score(right, prompt)


async def test_a_reward_function_that_fails_dead_letters_the_rollout_with_the_reason(plugin: str) -> None:
    bus = MemoryBus(topic_specs())
    await bus.start()
    prompts = generate_prompts("arith", seed=0, n=2)
    for prompt in prompts:
        rollout = episode_to_rollout(await played(prompt, "1"), prompt=prompt, group_index=0)
        await bus.send(ROLLOUTS, rollout)
    worker = RewardWorker(bus=bus, scorers=[VerifierScorer(function=RewardFunction.load(f"{plugin}:nan"))])
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    dead = []
    for _ in range(100):
        dead = await read_dead_letters(bus, ROLLOUTS.name)
        if len(dead) == 2:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    assert len(dead) == 2 and worker.scored == 0
    assert {d.error_class for d in dead} == {"RewardFunctionError"}
    assert f"reward.function {plugin}:nan returned nan" in dead[0].error
