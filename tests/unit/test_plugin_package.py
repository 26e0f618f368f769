"""A user's engine and reward scorer plug in from outside rlbus, through real entry points.

``tests/fixtures/plugin_pkg`` is a package as pip leaves it: the code beside its ``*.dist-info`` (METADATA,
entry_points.txt), so its directory on ``sys.path`` / ``PYTHONPATH`` is an installed package whose ``rlbus.engines``
and ``rlbus.scorers`` entry points ``importlib.metadata`` finds. In this process: the registries list the names
without loading them, load them on use, and name a broken entry point; a run config names them (the scorer's
``[reward.length]`` parsed into its own struct, errors naming its fields); the user's engine serves a rollout
worker that plays a prompt on the in-memory bus and the reward worker scores every rollout with the user's scorer
beside the verifier. In a fresh process: ``rlbus config check`` loads both through ``PYTHONPATH``, and without
the package fails naming the field and what is registered.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS, topic_specs
from rlbus.consumers.rollout import episode_threads
from rlbus.engines.kinds import ENGINES, engine_kind
from rlbus.envs.episode import rollout_to_episode
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import ConfigError
from rlbus.launch.arguments import model_source, reward_args, rollout_args
from rlbus.launch.config import RunConfig, config_from_dict, to_tables
from rlbus.rewards.scorers import SCORERS
from rlbus.schemas import Reward, Rollout
from rlbus.wiring.reward import reward_worker
from rlbus.wiring.rollout import rollout_stack

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "fixtures" / "plugin_pkg"
RUN = """\
[task]
group_size = 2
[model]
d_model = 32
n_layer = 1
n_head = 2
d_ff = 32
[rollout]
engine = "static"
max_batch = 4
[reward]
kind = "verifier-length"
scorers = ["verifier", "length"]
[reward.length]
target = 2
[trainer]
reward_sources = ["verifier", "length"]
"""


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plug-in package installed (its directory on sys.path, as PYTHONPATH would put it)."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    yield
    for registry, name in ((ENGINES, "static"), (SCORERS, "length"), (SCORERS, "broken")):
        registry.loaded.pop(name, None)
    for module in [m for m in sys.modules if m.split(".")[0] == "rlbus_userplug"]:
        del sys.modules[module]


def run_config() -> RunConfig:
    import tomllib

    return config_from_dict(tomllib.loads(RUN), {})


def test_the_registries_list_installed_plug_ins_and_load_them_on_use(installed: None) -> None:
    assert "static" in ENGINES.names() and {"length", "broken", "verifier", "judge"} <= set(SCORERS.names())
    assert "rlbus_userplug" not in sys.modules  # listed, not loaded
    assert type(engine_kind("static")).__name__ == "StaticTorch"
    assert SCORERS.get("length").__name__ == "LengthScorer"
    with pytest.raises(ConfigError) as info:
        SCORERS.get("broken")
    assert info.value.field == "reward.kind"
    assert ("entry point 'broken' (rlbus_userplug.missing:Nope, group 'rlbus.scorers') failed to load: "
            "ModuleNotFoundError") in info.value.problem


def test_a_run_config_names_them_and_parses_the_scorers_own_table(installed: None) -> None:
    config = run_config()
    assert config.rollout.engine == "static" and config.reward.scorer_names() == ["verifier", "length"]
    assert config.reward.options == {"length": {"target": 2}}
    tables = to_tables(config)
    assert tables["reward"]["length"] == {"target": 2} and "options" not in tables["reward"]
    assert config_from_dict(tables, {}) == config  # [reward.length] round-trips

    def field_of(reward: dict[str, object]) -> ConfigError:
        with pytest.raises(ConfigError) as info:
            config_from_dict({"reward": reward, "trainer": {"reward_sources": ["length"]}}, {})
        return info.value

    assert field_of({"kind": "length", "length": {"target": 0}}).field == "reward.length.target"
    typo = field_of({"kind": "length", "length": {"targt": 3}})
    assert typo.field == "reward.length.targt" and "did you mean `target`?" in typo.problem
    assert field_of({"kind": "verifier", "length": {"target": 3}}).field == "reward.length"  # not scoring here
    shared = field_of({"scorers": ["verifier", "length"]})  # kind "verifier" would share the verifier's group
    assert shared.field == "reward.kind" and "reward-<kind>" in shared.problem
    assert field_of({"kind": "lenght"}).problem.startswith("unknown scorer 'lenght'; did you mean `length`?")


def test_without_the_package_the_names_are_unknown_and_what_is_registered_is_listed() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"rollout": {"engine": "vlm"}}, {})
    assert info.value.field == "rollout.engine"
    assert "unknown engine 'vlm'; did you mean `vllm`?; registered: torch, vllm" in info.value.problem
    with pytest.raises(ConfigError) as info:
        config_from_dict({"reward": {"kind": "length"}}, {})
    assert info.value.field == "reward.kind" and "'rlbus.scorers' entry point" in info.value.problem


async def test_the_users_engine_plays_and_the_users_scorer_scores_on_the_bus(installed: None) -> None:
    episode_threads(4)
    config = run_config()
    bus = MemoryBus(topic_specs())
    await bus.start()
    stack = rollout_stack(bus=bus, store=None, model=model_source(config), worker_id="w", seed=0,
                          **rollout_args(config))
    front = stack.batching.engine
    assert type(front).__name__ == "StaticBatches"  # the user's kind built the stack
    scoring = reward_worker(bus=bus, **reward_args(config))
    assert [type(s).__name__ for s in scoring.scorers] == ["VerifierScorer", "LengthScorer"]
    [prompt] = generate_prompts(config.task.env, seed=3, n=1, config=config.task.env_config)
    prompt = msgspec.structs.replace(prompt, group_size=config.task.group_size)  # as the producer publishes it
    await bus.send(PROMPTS, prompt)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(stack.worker.run(stop)), asyncio.create_task(scoring.run(stop))]
    rollouts: list[Rollout] = []
    rewards: list[Reward] = []
    async with bus.consumer([ROLLOUTS, REWARDS], group=None) as consumer:
        for _ in range(300):
            for record in await consumer.getmany(timeout_s=0.1):
                (rollouts if isinstance(record.value, Rollout) else rewards).append(record.value)
            if len(rewards) == 2 * prompt.group_size:
                break
    stop.set()
    await asyncio.gather(*tasks)

    assert len(rollouts) == prompt.group_size and front.calls >= 1
    assert {(r.rollout_id, r.source) for r in rewards} == {(x.rollout_id, s) for x in rollouts
                                                          for s in ("verifier", "length")}
    for rollout in rollouts:
        length = len(rollout_to_episode(rollout).answer or "")
        [mine] = [r for r in rewards if r.rollout_id == rollout.rollout_id and r.source == "length"]
        assert mine.value == max(0.0, 1.0 - abs(length - 2) / 2)
    stats = scoring.stats()
    assert stats["group"] == "reward-verifier-length" and stats["length_scored"] == prompt.group_size
    assert sum(scoring.dead_letters.counts.values()) == 0


def rlbus_cli(*args: str, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    """``rlbus ARGS`` in a fresh interpreter (this checkout's rlbus first), run from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    script = "import sys; from rlbus.cli import main; sys.argv[0] = 'rlbus'; main()"
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


@pytest.mark.slow
def test_a_fresh_process_finds_the_plug_ins_through_pythonpath(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(RUN)
    done = rlbus_cli("config", "check", str(run), pythonpath=[REPO, PLUGINS])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rollout: engine 'static' loads; its rollout workers run in this Python environment" in done.stdout
    assert "reward: scorer 'length' loads (rlbus_userplug.scorer:LengthScorer)" in done.stdout
    assert "[reward.length]\ntarget = 2\n" in done.stdout

    missing = rlbus_cli("config", "check", str(run), pythonpath=[REPO])
    assert missing.returncode == 1
    said = missing.stdout + missing.stderr
    assert "rollout.engine" in said and "unknown engine 'static'" in said and "registered: torch, vllm" in said
