"""The ``verifiers`` adapter (rlbus.envs.adapters.verifiers) on small real verifiers tasksets
(tests/fixtures/verifiers_tasksets.py): seeded prompts, scoring by the task's own ``@vf.reward`` methods on a
trace of a real episode (played through the harness and carried in a rollout, scored as the reward worker
scores it), verifiers' weights, what is refused and where, and a few RL steps of the embedded demo on it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rlbus.envs.adapters.verifiers import IDX_KEY, SYSTEM_KEY, TASK_KEY, VerifiersTask, _trace
from rlbus.envs.agent import run_episode
from rlbus.envs.base import env_for, make_env
from rlbus.envs.chat import ChatFormat, format_answer
from rlbus.envs.episode import Episode, episode_to_rollout, rollout_to_episode
from rlbus.envs.scripted import ScriptedEngine
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import ConfigError, RewardFunctionError
from rlbus.schemas import Prompt, Reward, Rollout, Turn
from rlbus.schemas.base import decode, encode

FIXTURES = "tests.fixtures.verifiers_tasksets"
SUMS = f"verifiers:{FIXTURES}:Sums"
CHAT = ChatFormat.for_byte_tokenizer()
REPO = Path(__file__).resolve().parents[3]


async def scored(prompt: Prompt, *turns: str, max_turns: int = 1) -> Reward:
    """``prompt`` played through the harness with these model turns, shipped as a rollout and scored from it
    as the reward worker does (`RewardWorker._verify`: ``env_for(prompt).score``)."""
    env_config = {**prompt.env_config, "max_turns": max_turns}
    prompt = msgspec.structs.replace(prompt, env_config=env_config)
    engine = ScriptedEngine(list(turns), tokenizer=CHAT.tokenizer)
    episode = await run_episode(env_for(prompt), prompt, engine=engine, chat=CHAT, episode_id=f"{prompt.prompt_id}-ep")
    sent = episode_to_rollout(episode, prompt=prompt, group_index=0)
    rollout = decode(Rollout, encode(sent))  # as it crosses the bus
    assert rollout.prompt is not None
    return await env_for(rollout.prompt).score(rollout_to_episode(rollout), rollout.prompt)


def test_registering_the_adapter_does_not_import_verifiers() -> None:
    code = ("import sys, rlbus.envs; from rlbus.envs.base import env_type; "
            f"assert env_type({SUMS!r}).__name__ == 'VerifiersTask'; print('verifiers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False, env={"PYTHONPATH": str(REPO), "PATH": ""})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_prompts_are_drawn_deterministically_from_the_taskset() -> None:
    config = {"config": {"size": 6}}
    first = generate_prompts(SUMS, seed=3, n=14, config=config)
    assert first == generate_prompts(SUMS, seed=3, n=14, config=config)
    assert [p.text for p in first] != [p.text for p in generate_prompts(SUMS, seed=4, n=14, config=config)]
    # A seeded permutation of all six tasks, then another: every task before any repeats.
    assert sorted(int(p.metadata[IDX_KEY]) for p in first[:6]) == list(range(6))
    assert sorted(int(p.metadata[IDX_KEY]) for p in first[6:12]) == list(range(6))
    for p in first:
        a, b = p.text.removesuffix("=").split("+")
        assert p.env == SUMS and p.reference == str(int(a) + int(b))
        assert set(p.metadata) == {IDX_KEY, TASK_KEY, "dataset"} and len(p.metadata[TASK_KEY]) == 64
        assert p.env_config["taskset"] == f"{FIXTURES}:Sums" and p.env_config["config"] == {"size": 6}
    assert len({p.prompt_id for p in first}) == 14
    env = make_env(SUMS, config)
    assert isinstance(env, VerifiersTask)
    assert env.reference_turns(first[0]) == [format_answer(str(first[0].reference))]


async def test_a_right_answer_scores_the_tasks_reward_and_a_wrong_one_zero() -> None:
    right, wrong = generate_prompts(SUMS, seed=0, n=2, config={"config": {"size": 10}})
    reward = await scored(right, format_answer(str(right.reference)))
    assert reward.value == 1.0 and reward.source == "verifier" and reward.reward_id == f"{right.prompt_id}-ep:verifier"
    assert reward.components == {"correct": 1.0, "metric.turns": 1.0}
    assert reward.metadata["grader"] == f"verifiers:{FIXTURES}:Sums"
    assert reward.metadata["verifiers.idx"] == right.metadata[IDX_KEY]
    # The task's reward that needs a runtime is skipped by verifiers' offline scoring, and said so.
    assert reward.metadata["verifiers.skipped"] == "checked_in_box" and "checked_in_box" in reward.reason

    reward = await scored(wrong, format_answer(str(int(str(wrong.reference)) + 1)))
    assert reward.value == 0.0 and reward.components["correct"] == 0.0

    reward = await scored(right, f"thinking about {right.text}")  # no <answer>: the turn limit ends it
    assert reward.value == 0.0 and reward.reason.startswith("no answer (episode ended with 'max_turns')")

    # Two turns: the harness's complaint about a malformed action in between, then the answer.
    reward = await scored(right, "<tool>", format_answer(str(right.reference)), max_turns=2)
    assert reward.value == 1.0 and reward.components["metric.turns"] == 2.0


async def test_weights_of_several_rewards_combine_as_verifiers_combines_them() -> None:
    weighted = f"verifiers:{FIXTURES}:WeightedSums"
    (prompt,) = generate_prompts(weighted, seed=1, n=1, config={"config": {"size": 5}})
    answer = str(prompt.reference)
    concise = await scored(prompt, format_answer(answer))  # correct ×1 + concise ×0.5
    assert concise.value == 1.5 and concise.components == {"correct": 1.0, "concise": 1.0, "metric.turns": 1.0}
    assert json.loads(concise.metadata["verifiers.weights"]) == {"concise": 0.5, "correct": 1.0}
    assert (await scored(prompt, f"The sum is {answer}. {format_answer(answer)}")).value == 1.0
    assert (await scored(prompt, format_answer("-1"))).value == 0.5  # concise, wrong

    # Rewards plugged and reweighted by the taskset config (config.task.rewards), as verifiers merges them.
    plugged = {"config": {"size": 5, "task": {"rewards": {
        "correct": {"weight": 2.0},
        "brevity": {"fn": f"{FIXTURES}:plugged_brevity", "weight": 0.25},
    }}}}
    (prompt,) = generate_prompts(SUMS, seed=1, n=1, config=plugged)
    reward = await scored(prompt, format_answer(str(prompt.reference)))
    brevity = float(len(str(prompt.reference)) <= 2)
    assert reward.value == 2.0 + 0.25 * brevity
    assert json.loads(reward.metadata["verifiers.weights"]) == {"brevity": 0.25, "correct": 2.0}


async def test_a_reward_that_raises_fails_scoring_with_the_reason() -> None:
    config = {"config": {"size": 3, "task": {"rewards": {"broken": {"fn": f"{FIXTURES}:plugged_failure"}}}}}
    (prompt,) = generate_prompts(SUMS, seed=0, n=1, config=config)
    with pytest.raises(RewardFunctionError, match="the grader is broken"):
        await scored(prompt, format_answer("1"))


def test_the_trace_holds_the_tasks_prompt_and_what_the_model_wrote() -> None:
    """A summarized episode as verifiers sees it: the task's own prompt messages, every model turn (raw), what
    the harness said in between; each new context's reopening (system, task, summary) is left out."""
    (prompt,) = generate_prompts(f"verifiers:{FIXTURES}:ChatTaskset", seed=0, n=1)
    env = env_for(prompt)
    assert isinstance(env, VerifiersTask)
    task = env.task_of(prompt)
    said = [("system", "rules", 0), ("user", prompt.text, 0), ("assistant", "<tool>", 0), ("tool", "malformed", 0),
            ("user", "Summarize.", 0), ("assistant", "<summary>5?</summary>", 0), ("system", "rules", 1),
            ("user", prompt.text, 1), ("summary", "5?", 1), ("assistant", "so <answer> 5 </answer>", 1)]
    turns = [Turn(role=role, text=text, start=i, end=i + 1, segment=segment) for i, (role, text, segment) in
             enumerate(said)]
    episode = Episode(episode_id="ep", token_ids=[], loss_mask=[], logprobs=[], token_versions=[], turns=turns,
                      finish_reason="stop", answer=" 5 ")
    trace = _trace(task, episode)
    assert [(m.role, m.content) for m in trace.messages] == [
        ("system", "You add numbers."), ("system", "Answer with the number only."), ("user", "1+1="),
        ("assistant", "2"), ("user", "2+3="), ("assistant", "<tool>"), ("user", "malformed"),
        ("user", "Summarize."), ("assistant", "<summary>5?</summary>"), ("assistant", "so <answer> 5 </answer>"),
    ]
    assert trace.num_turns == 3 and trace.last_reply == "5" and trace.stop_condition == "agent_completed"
    cut = _trace(task, Episode(episode_id="ep", token_ids=[], loss_mask=[], logprobs=[], token_versions=[],
                               turns=turns[:3], finish_reason="length"))
    assert cut.last_reply == "" and cut.is_truncated


async def test_a_message_prompt_is_flattened_and_its_system_prompt_opens_the_episode() -> None:
    env = f"verifiers:{FIXTURES}:ChatTaskset"
    (prompt,) = generate_prompts(env, seed=0, n=1)
    assert prompt.text == "user: 1+1=\n\nassistant: 2\n\nuser: 2+3="
    assert prompt.metadata[SYSTEM_KEY] == "You add numbers.\n\nAnswer with the number only."
    task = env_for(prompt)
    async with task.world(prompt) as world:
        system = task.instructions(world)
        assert system is not None and system.startswith(prompt.metadata[SYSTEM_KEY] + "\n\n")
        assert system.endswith(format_answer("ANSWER") + ".")
    quiet = make_env(env, {**prompt.env_config, "instructions": False})
    async with quiet.world(prompt) as world:
        assert quiet.instructions(world) == prompt.metadata[SYSTEM_KEY]
    assert (await scored(prompt, format_answer("5"))).value == 1.0


async def test_a_prompt_that_does_not_match_its_regenerated_task_raises() -> None:
    config = {"config": {"size": 4}}
    (prompt,) = generate_prompts(SUMS, seed=0, n=1, config=config)
    episode_turn = format_answer(str(prompt.reference))
    with pytest.raises(ValueError, match="has another prompt here"):
        await scored(msgspec.structs.replace(prompt, text="2+2="), episode_turn)
    with pytest.raises(ValueError, match="has another prompt here"):  # the worker's taskset config differs
        other = {**prompt.env_config, "config": {"size": 4, "seed": 1}}
        await scored(msgspec.structs.replace(prompt, env_config=other), episode_turn)
    with pytest.raises(ValueError, match="has other data here"):
        await scored(msgspec.structs.replace(prompt, metadata={**prompt.metadata, TASK_KEY: "0" * 64}), episode_turn)
    with pytest.raises(ValueError, match="has no task 9 here"):
        await scored(msgspec.structs.replace(prompt, metadata={**prompt.metadata, IDX_KEY: "9"}), episode_turn)
    bare = Prompt(prompt_id="hand-written", env=SUMS, text=prompt.text, env_config=prompt.env_config)
    with pytest.raises(ValueError, match="does not locate its verifiers task"):
        await scored(bare, episode_turn)
    with pytest.raises(ConfigError) as err:
        env_for(bare).validate_prompt(bare)
    assert err.value.field == f"metadata.{IDX_KEY}"


def config_error(env: str, config: dict[str, Any] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        task = make_env(env, config)
        assert isinstance(task, VerifiersTask)
        task.generate(0, 1)
    return err.value


@pytest.mark.parametrize(
    ("env", "config", "field", "says"),
    [
        ("verifiers:no-such-taskset", None, "env_config.taskset", "taskset 'no-such-taskset' does not load"),
        ("verifiers:textarenna", None, "env_config.taskset", "did you mean `textarena`"),
        (f"verifiers:{FIXTURES}:Nope", None, "env_config.taskset", "has no attribute 'Nope'"),
        (f"verifiers:{FIXTURES}:SumTask", None, "env_config.taskset", "is not a verifiers Taskset subclass"),
        (f"verifiers:{FIXTURES}:Containers", None, "env_config.taskset", "need a container"),
        (f"verifiers:{FIXTURES}:InTheBox", None, "env_config.taskset", "every reward of BoxTask needs a runtime"),
        (f"verifiers:{FIXTURES}:Counting", None, "env_config.limit", "is infinite"),
        (SUMS, {"config": {"sise": 3}}, "env_config.config.sise", "is not a field of SumsConfig; did you mean `size`"),
        (SUMS, {"config": {"digits": "many"}}, "env_config.config.digits", "valid integer"),
        (SUMS, {"config": {"id": "other"}}, "env_config.config.id", "is the taskset's name"),
        (SUMS, {"config": {"task": {"judges": [{"id": "reference"}]}}}, "env_config.config.task.judges",
         "judges call a model"),
        (SUMS, {"limit": 0}, "env_config.limit", "limit must be ≥ 1"),
        (SUMS, {"taskset": "other"}, "env_config.taskset", "contradicts"),
        (SUMS, {"max_trns": 2}, "env_config.max_trns", ""),
    ],
)
def test_config_errors_name_the_field(env: str, config: dict[str, Any] | None, field: str, says: str) -> None:
    error = config_error(env, config)
    assert error.field == field and says in error.problem, error


def test_an_infinite_taskset_runs_with_a_limit() -> None:
    prompts = generate_prompts(f"verifiers:{FIXTURES}:Counting", seed=0, n=8, config={"limit": 4})
    assert sorted({p.text for p in prompts}) == ["0+1=", "1+1=", "2+1=", "3+1="]


@pytest.fixture
def taskset_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two installed taskset packages as verifiers finds them by id: one exporting ``Sums``, one a taskset
    with its own `Env` (a game)."""
    (tmp_path / "rlbus_vf_sums.py").write_text(f"from {FIXTURES} import Sums\n\n__all__ = ['Sums']\n")
    (tmp_path / "rlbus_vf_game.py").write_text(textwrap.dedent(f"""
        import verifiers.v1 as vf
        from {FIXTURES} import Sums


        class Game(vf.Env):
            async def run(self, task, agents):
                pass


        __all__ = ["Game", "Sums"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("rlbus_vf_sums", "rlbus_vf_game"):
        sys.modules.pop(name, None)


def test_a_taskset_is_found_by_its_verifiers_id(taskset_packages: None) -> None:
    (prompt,) = generate_prompts("verifiers:rlbus-vf-sums", seed=0, n=1, config={"config": {"size": 3}})
    assert prompt.env == "verifiers:rlbus-vf-sums" and prompt.env_config["taskset"] == "rlbus-vf-sums"
    error = config_error("verifiers:rlbus-vf-game")
    assert error.field == "env_config.taskset" and "runs in its own verifiers Env (Game)" in error.problem


async def test_the_demo_trains_a_few_steps_on_a_verifiers_taskset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """The embedded demo (every role in process: prompt producer, rollout workers, reward worker, trainer) on
    `Sums` — warm start from the task's references, RL rewards from its own ``@vf.reward``."""
    from rlbus.demo import Demo, DemoConfig

    rewards: list[Reward] = []
    score = VerifiersTask.score

    async def recorded(self: VerifiersTask, episode: Any, prompt: Prompt) -> Reward:
        rewards.append(await score(self, episode, prompt))
        return rewards[-1]

    monkeypatch.setattr(VerifiersTask, "score", recorded)
    env_config = {"config": {"size": 200}, "instructions": False, "max_new_tokens": 32, "context_tokens": 64,
                  "max_total_tokens": 64}
    config = dataclasses.replace(
        DemoConfig.quick().tuned(trainer={"warm_steps": 10, "groups_per_step": 2},
                                 task={"group_size": 4, "env": SUMS, "env_config": env_config}),
        workers=1, rl_steps=2, time_budget_s=120, eval_size=4,
    )
    demo = Demo(config, tmp_path)
    assert {p.env for p in demo.eval_prompts()} == {SUMS}
    result = await demo.run()
    assert result.steps == 2 and result.rollouts_trained >= 2 * 2 * 4
    assert result.outcomes["dead_lettered"] == 0
    assert rewards and {r.metadata["grader"] for r in rewards} == {f"verifiers:{FIXTURES}:Sums"}
    assert all(r.value in (0.0, 1.0) and r.metadata["verifiers.skipped"] == "checked_in_box" for r in rewards)
