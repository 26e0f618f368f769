"""The OpenAI-compatible judge backend against ``rlbus serve``'s gateway serving SmolLM2.

The judge is built from config alone (`rlbus.launch.arguments.judge_for`: ``backend = "openai"``, the key from
a file) and talks HTTP to the real gateway (`rlbus.serve.stack.serve_stack`, the engine stack over
SmolLM2, bearer-token tenants). Every judge call is served traffic, so it is also recorded token-exact on
``rl.served.v1``. The gateway accepts only the fields it honours, so a prefilled judge (vLLM's
``continue_final_message``) is refused with an OpenAI error body — a `JudgeError`, never a zero reward.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.errors import JudgeError
from rlbus.launch.arguments import judge_for
from rlbus.launch.config import config_from_dict
from rlbus.schemas import Prompt
from rlbus.serve.auth import Tenants
from rlbus_tools.bench.judge import answered

ROOT = Path(__file__).resolve().parents[2]
KEY = "judge-token-0123456789abcdef"
PROMPT = Prompt(prompt_id="p0", env="arith", text="12+30=", reference="42")


@pytest.fixture(scope="module")
def smollm2_source() -> Any:
    from rlbus.models.sources import parse_model

    return parse_model("smollm2-135m-instruct")


@pytest.fixture
async def gateway(smollm2_source: Any) -> AsyncIterator[tuple[str, Any]]:
    from rlbus.serve.stack import serve_stack

    async with MemoryBus(topic_specs()) as bus:
        stack = serve_stack(bus=bus, source=smollm2_source, tenants=Tenants({"judge": KEY}), model_name="smollm2",
                            default_max_tokens=16)  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(stack.gateway.run(stop, "127.0.0.1", 0))
        await asyncio.wait_for(stack.gateway.listening.wait(), 120)
        host, port = stack.gateway.address or ("", 0)
        try:
            yield f"http://{host}:{port}/v1", stack
        finally:
            stop.set()
            await task


def judge_config(url: str, key_file: Path, **judge: Any) -> Any:
    rubric = ROOT / "infra" / "rlbus" / "rubrics" / "answer.toml"
    return config_from_dict({"reward": {"kind": "judge", "judge": {
        "rubric": str(rubric), "backend": "openai", "base_url": url, "model": "smollm2", "api_key_file": str(key_file),
        "retries": 0, "timeout_s": 600, **judge}}}, {})  # fmt: skip


async def test_rlbus_serve_judges_through_config(gateway: tuple[str, Any], tmp_path: Path) -> None:
    url, stack = gateway
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    judge = judge_for(judge_config(url, key, max_tokens=16, parse_retries=1))
    assert judge is not None
    try:
        reward = await judge.score(answered("served", "42"), PROMPT)
    finally:
        await judge.close()
    invalid = {n for n in reward.metadata.get("judge_invalid", "").split(",") if n}
    assert set(reward.components) | invalid == {"correct", "concise"} and not set(reward.components) & invalid
    assert 0.0 <= reward.value <= 1.0 and (reward.metadata["judge_valid"] == "false") == bool(invalid)
    calls = 2 + int(reward.metadata["judge_retries"])
    assert stack.recorder is not None and await stack.recorder.flush()
    assert stack.recorder.recorded >= calls  # every judge call was served and recorded
    print("rlbus serve + SmolLM2 judge:", reward.reason)


async def test_a_prefill_the_gateway_does_not_honour_is_a_judge_error(gateway: tuple[str, Any],
                                                                     tmp_path: Path) -> None:
    url, _ = gateway
    key = tmp_path / "key"
    key.write_text(KEY)
    judge = judge_for(judge_config(url, key, prefill="SCORE: ", max_tokens=4))
    assert judge is not None
    try:
        with pytest.raises(JudgeError, match="HTTP 400"):
            await judge.score(answered("prefill", "42"), PROMPT)
    finally:
        await judge.close()
