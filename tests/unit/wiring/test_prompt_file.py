"""``[task] prompts``: a run config naming a JSONL file feeds the producer exactly the file's prompts, in order
and cycling; a missing file fails when the config loads, a bad line when the producer is built."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import PROMPTS
from rlbus.envs.tasks.jsonl import validate_prompts
from rlbus.errors import ConfigError, PromptFileError
from rlbus.launch.arguments import producer_args
from rlbus.launch.config import load_config
from rlbus.state.memory import MemoryStateStore
from rlbus.wiring.infra import open_bus
from rlbus.wiring.producer import prompt_producer

LINES = [
    {"env": "answer", "text": "Ann has 3 boxes of 12 eggs. How many eggs?", "reference": "36"},
    {"env": "answer", "text": "A train goes 60 km an hour for 2.5 hours. How far, in km?", "reference": "150",
     "group_size": 4},
    {"env": "answer", "text": "Name the colour of the sky.", "reference": "blue", "env_config": {"match": "exact"}},
]


def run_toml(tmp_path: Path, prompts: str) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(f'[state]\nurl = "memory://"\n[task]\nprompts = "{prompts}"\ngroup_size = 6\n')
    return config


def problems(tmp_path: Path, lines: list[str] | None = None) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(lines if lines is not None else [json.dumps(line) for line in LINES]) + "\n")
    return path


async def test_the_producer_emits_the_files_prompts_in_order_cycling(tmp_path: Path) -> None:
    config = load_config(run_toml(tmp_path, str(problems(tmp_path))), environ={})
    assert config.task.prompts == str(tmp_path / "problems.jsonl")
    bus = open_bus(None, partitions=1)
    await bus.start()
    producer = prompt_producer(bus=bus, state=MemoryStateStore(), **producer_args(config), limit=7)
    await producer.run(asyncio.Event())
    async with bus.consumer([PROMPTS], group=None) as consumer:
        prompts = [r.value for r in await consumer.getmany(timeout_s=0.5)]
    await bus.close()
    prompts.sort(key=lambda p: int(p.metadata["seq"]))
    assert [p.text for p in prompts] == [line["text"] for line in LINES * 3][:7]
    assert [p.reference for p in prompts] == ["36", "150", "blue"] * 2 + ["36"]
    assert {p.env for p in prompts} == {"answer"}  # each line's env, not [task] env (arith)
    assert [p.group_size for p in prompts[:3]] == [6, 4, 6]  # [task] group_size for lines that give none
    assert prompts[2].env_config == {"match": "exact"}
    assert prompts[0].prompt_id.endswith("-problems-1") and prompts[3].prompt_id.endswith("-problems-1-e1")


async def test_a_restarted_producer_continues_the_cycle_where_the_run_left_off(tmp_path: Path) -> None:
    config = load_config(run_toml(tmp_path, str(problems(tmp_path))), environ={})
    bus = open_bus(None, partitions=1)
    await bus.start()
    producer = prompt_producer(bus=bus, state=MemoryStateStore(), **producer_args(config), start=4, limit=2)
    await producer.run(asyncio.Event())
    async with bus.consumer([PROMPTS], group=None) as consumer:
        prompts = sorted((r.value for r in await consumer.getmany(timeout_s=0.5)), key=lambda p: int(p.metadata["seq"]))
    await bus.close()
    assert [(p.metadata["seq"], p.reference) for p in prompts] == [("4", "150"), ("5", "blue")]


def test_a_missing_file_fails_at_load_naming_task_prompts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(run_toml(tmp_path, str(tmp_path / "nowhere.jsonl")), environ={})
    assert info.value.field == "task.prompts" and "does not exist" in str(info.value)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"env": "answer", "text": "How many?", "reference": "many"}', "is not a number"),
        ('{"env": "answer", "text": "How many?"}', "needs a reference"),
        ('{"env": "answer", "text": "How many?", "reference": "3", "env_config": {"match": "fuzzy"}}',
         "env_config.match"),
        ('{"env": "answer", "text": "How many?", "reference": "3"', "not valid JSON"),
    ],
)
def test_a_bad_line_fails_when_the_producer_is_built_naming_file_and_line(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = problems(tmp_path, [json.dumps(LINES[0]), "", line, json.dumps(LINES[1])])
    config = load_config(run_toml(tmp_path, str(path)), environ={})  # loads: lines are checked at start
    with pytest.raises(PromptFileError) as info:
        prompt_producer(bus=MemoryBus(), state=MemoryStateStore(), **producer_args(config))
    assert info.value.field == f"{path}:3" and problem in str(info.value)
    with pytest.raises(PromptFileError) as again:
        validate_prompts(path)
    assert str(again.value) == str(info.value)



def test_the_docs_example_file_and_config_load_and_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = (Path(__file__).resolve().parents[3] / "docs" / "your-task.md").read_text()
    example = section.split("```json\n", 1)[1].split("```", 1)[0]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    reward = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "problems.jsonl").write_text(example)
    (tmp_path / "held_out.jsonl").write_text(example)
    (tmp_path / "myreward.py").write_text(reward)  # the page's reward function, beside the config
    (tmp_path / "run.toml").write_text(toml)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=. in the page's commands
    assert validate_prompts("problems.jsonl") == 3
    config = load_config(Path("run.toml"), environ={})
    assert config.task.prompts == "problems.jsonl" and config.trainer.warm_steps == 0
    assert config.task.eval_prompts == "held_out.jsonl" and config.reward.function == "myreward:score"
    from rlbus.rewards.function import RewardFunction

    score = RewardFunction.load("myreward:score").function
    assert score("2+2?", "I think it is 31 eggs", "31") == 1.0 and score("2+2?", "<answer>3</answer>", "31") == 0.0
