"""The operator's commands against a real broker: topics, replay to a file, dead letters."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from typer.testing import CliRunner

from rlbus.bus.topics import PROMPTS, topic_specs
from rlbus.cli.app import app
from rlbus.schemas import Prompt
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

runner = CliRunner()


def invoke(*args: str) -> str:
    result = runner.invoke(app, [*args], env={"RLBUS_KAFKA_BOOTSTRAP": KAFKA_BOOTSTRAP})
    assert result.exit_code == 0, result.output
    return result.output


def test_topics_create_list_describe() -> None:
    invoke("topics", "create")
    listed = invoke("topics", "list")
    for spec in topic_specs():
        assert spec.name in listed
    described = json.loads(invoke("topics", "describe", "rl.weights.latest.v1"))
    assert described["config"]["cleanup.policy"] == "compact"


def test_replay_by_offset_window_to_jsonl(tmp_path: Path) -> None:
    invoke("topics", "create")
    marker = uuid.uuid4().hex

    async def produce() -> dict[int, int]:
        bus = await kafka_bus()
        async with bus:
            before = await bus.end_offsets(PROMPTS.name)
            for i in range(5):
                await bus.send(PROMPTS, Prompt(prompt_id=f"{marker}-{i}", env="arith", text="x", group_size=2))
            return before

    before = asyncio.run(produce())
    out = tmp_path / "prompts.jsonl"
    invoke("replay", "--topic", PROMPTS.name, "--from", str(min(before.values())), "--out", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    mine = sorted(r["value"]["prompt_id"] for r in lines if r["value"]["prompt_id"].startswith(marker))
    assert mine == [f"{marker}-{i}" for i in range(5)]


def test_missing_topic_is_one_clear_line() -> None:
    result = runner.invoke(app, ["replay", "--topic", "no.such.topic", "--out", "/dev/null"],
                           env={"RLBUS_KAFKA_BOOTSTRAP": KAFKA_BOOTSTRAP})
    assert result.exit_code == 1
    assert "does not exist" in result.output
