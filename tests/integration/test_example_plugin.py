"""The example package (examples/wordproblems) end to end: a user's environment and reward function named by
import path in a run config, found through sys.path / PYTHONPATH by every process that loads the config.

On the embedded path: the config loads, the prompt producer's stream draws the user's word problems, the
harness plays a right and a wrong answer, and the reward worker built from the config (`reward_args`, as the
demo and ``rlbus worker reward`` build it) scores them with the user's function. In a fresh process:
``rlbus config check`` (which builds the environment, as ``rlbus worker prompts`` does) passes with the
example on PYTHONPATH, and without it fails naming the field and the fix."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import REWARDS, ROLLOUTS, topic_specs
from rlbus.envs import base
from rlbus.envs.agent import run_episode
from rlbus.envs.base import env_for, make_env
from rlbus.envs.chat import ChatFormat, format_answer
from rlbus.envs.episode import episode_to_rollout
from rlbus.envs.scripted import ScriptedEngine
from rlbus.launch.arguments import producer_args, reward_args
from rlbus.launch.config import load_config
from rlbus.producers.prompts import task_prompts
from rlbus.schemas import Prompt, Reward, Rollout
from rlbus.wiring.reward import reward_worker

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "wordproblems"
RUN = EXAMPLE / "run.toml"
CHAT = ChatFormat.for_byte_tokenizer()


@pytest.fixture
def example_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    sys.modules.pop("wordproblems", None)
    base._LOADED.pop("wordproblems:WordProblems", None)


async def played(prompt: Prompt, answer: str) -> Rollout:
    engine = ScriptedEngine([format_answer(answer)], tokenizer=CHAT.tokenizer)
    episode = await run_episode(env_for(prompt), prompt, engine=engine, chat=CHAT,
                                episode_id=f"{prompt.prompt_id}-{answer}")  # fmt: skip
    return episode_to_rollout(episode, prompt=prompt, group_index=0)


async def test_the_example_trains_on_its_own_task_and_reward(example_on_path: None) -> None:
    config = load_config(RUN, {})
    assert config.task.env == "wordproblems:WordProblems" and config.reward.function == "wordproblems:score"
    assert type(make_env(config.task.env, config.task.env_config)).__name__ == "WordProblems"

    args = producer_args(config)
    stream = task_prompts(args["env"], seed=args["seed"] + 1000, group_size=args["group_size"],
                          config=args["env_config"])  # what the prompt producer publishes
    prompts = list(itertools.islice(stream, 4))
    assert {p.env for p in prompts} == {"wordproblems:WordProblems"} and {p.group_size for p in prompts} == {4}
    assert all(p.reference is not None and p.reference.lstrip("-").isdigit() for p in prompts)

    bus = MemoryBus(topic_specs())
    await bus.start()
    right, wrong = prompts[0], prompts[1]
    await bus.send(ROLLOUTS, await played(right, str(right.reference)))
    await bus.send(ROLLOUTS, await played(wrong, str(int(str(wrong.reference)) + 1)))
    worker = reward_worker(bus=bus, **reward_args(config))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    rewards: list[Reward] = []
    async with bus.consumer([REWARDS], group=None) as consumer:
        for _ in range(200):
            rewards += [r.value for r in await consumer.getmany(timeout_s=0.1)]
            if len(rewards) >= 2:
                break
    stop.set()
    await task
    by_prompt = {r.prompt_id: r for r in rewards}
    assert by_prompt[right.prompt_id].value == 1.0 and by_prompt[wrong.prompt_id].value == 0.0
    assert {r.source for r in rewards} == {"verifier"} <= set(config.trainer.reward_sources)
    assert {r.metadata["function"] for r in rewards} == {"wordproblems:score"}
    assert sum(worker.dead_letters.counts.values()) == 0


def rlbus_cli(*args: str, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    """``rlbus ARGS`` in a fresh interpreter (this checkout's rlbus first), run from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    script = "import sys; from rlbus.cli import main; sys.argv[0] = 'rlbus'; main()"
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_a_worker_process_finds_the_example_through_pythonpath() -> None:
    done = rlbus_cli("config", "check", str(RUN), pythonpath=[REPO, EXAMPLE])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "task: 'wordproblems:WordProblems' builds from env_config and generates prompts" in done.stdout
    assert "reward: function wordproblems:score is callable" in done.stdout

    missing = rlbus_cli("config", "check", str(RUN), pythonpath=[REPO])
    assert missing.returncode == 1
    said = missing.stdout + missing.stderr
    assert "reward.function" in said and "cannot import module 'wordproblems'" in said and "PYTHONPATH" in said
