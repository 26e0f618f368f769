"""The OpenAI-compatible judge backend against a real model behind a real HTTP endpoint.

Until ``rlbus serve`` is on main, the endpoint is a small aiohttp server in this test that answers
``POST /v1/chat/completions`` from SmolLM2 in the torch engine (the model's own chat template, bearer-key
check, vLLM's ``continue_final_message`` for a prefilled reply). The judge is built from config alone
(`rlbus.launch.arguments.judge_for`), its key read from a file.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rlbus.launch.arguments import judge_for
from rlbus.launch.config import config_from_dict
from rlbus.rewards.judge import OpenAIJudge
from rlbus.schemas import Prompt
from rlbus_tools.bench.judge import answered

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-judge-test"
PROMPTS = [Prompt(prompt_id=f"p{i}", env="arith", text=f"{a}+{b}=", reference=str(a + b))
           for i, (a, b) in enumerate([(12, 30), (7, 8)])]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_engine() -> Any:
    from rlbus.models.sources import parse_model
    from rlbus.rewards.judge import engine_judge

    return engine_judge(parse_model("smollm2-135m-instruct"), max_new_tokens=32)


@pytest.fixture
async def endpoint(smollm2_engine: Any) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """``/v1/chat/completions`` answered by SmolLM2; returns (base url, request bodies seen)."""
    from rlbus.engines.base import GenerationRequest

    seen: list[dict[str, Any]] = []
    chat = smollm2_engine.chat

    async def completions(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "bad key", "type": "invalid_request_error"}}, status=401)
        body = await request.json()
        seen.append(body)
        messages = body["messages"]
        prefill = body.get("continue_final_message") and messages[-1]["role"] == "assistant"
        ids = list(chat.bos)
        for m in messages[:-1] if prefill else messages:
            ids += chat.message_ids(m["role"], m["content"])
        ids += chat.model_header
        if prefill:
            ids += chat.encode(messages[-1]["content"])
        generation = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=int(body["max_tokens"]),
                                       temperature=float(body["temperature"]), stop=tuple(body.get("stop") or ()),
                                       stop_token_ids=chat.stop_ids)  # fmt: skip
        [result] = await asyncio.to_thread(smollm2_engine.engine.generate, [generation])
        text = chat.decode(result.token_ids)
        return web.json_response({"object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}]})  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/v1")), seen
    finally:
        await server.close()


def judge_config(url: str, key_file: Path, **judge: Any) -> Any:
    rubric = ROOT / "infra" / "rlbus" / "rubrics" / "answer.toml"
    return config_from_dict({"reward": {"kind": "judge", "judge": {
        "rubric": str(rubric), "backend": "openai", "base_url": url, "model": "smollm2", "api_key_file": str(key_file),
        **judge}}}, {})  # fmt: skip


async def test_a_prefilled_smollm2_endpoint_judges_through_config(
    endpoint: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = endpoint
    key = tmp_path / "judge.key"
    key.write_text(KEY + "\n")
    judge = judge_for(judge_config(url, key, prefill="SCORE: ", max_tokens=4, parse_retries=1, timeout_s=600))
    assert judge is not None and isinstance(judge.backend, OpenAIJudge)
    try:
        rewards = [await judge.score(answered(f"r{i}", p.reference or ""), p) for i, p in enumerate(PROMPTS)]
    finally:
        await judge.close()
    assert seen and all(b["messages"][-1] == {"role": "assistant", "content": "SCORE: "} for b in seen)
    assert all([m["role"] for m in b["messages"]] == ["system", "user", "assistant"] for b in seen)
    for reward in rewards:
        assert reward.source == "judge" and 0.0 <= reward.value <= 1.0
        assert all(reward.metadata[f"reply.{name}"].startswith("SCORE: ") for name in ("correct", "concise"))
        invalid = {n for n in reward.metadata.get("judge_invalid", "").split(",") if n}
        assert set(reward.components) | invalid == {"correct", "concise"} and not set(reward.components) & invalid
    print("prefilled:", [(r.value, r.reason) for r in rewards])


async def test_a_free_form_smollm2_endpoint_gives_retried_and_flagged_judgements(
    endpoint: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Without a prefill SmolLM2 rarely ends with a score line: each unreadable reply is asked again once,
    then published invalid — a finite reward, flagged, never a crash or a silent zero."""
    url, seen = endpoint
    key = tmp_path / "judge.key"
    key.write_text(KEY)
    judge = judge_for(judge_config(url, key, max_tokens=16, parse_retries=1, retries=0, timeout_s=600))
    assert judge is not None
    try:
        reward = await judge.score(answered("free", "42"), PROMPTS[0])
    finally:
        await judge.close()
    invalid = [n for n in reward.metadata.get("judge_invalid", "").split(",") if n]
    assert len(seen) == 2 + int(reward.metadata["judge_retries"])  # one call per dimension, plus retries
    assert int(reward.metadata["judge_retries"]) >= len(invalid)
    assert set(invalid) | set(reward.components) == {"correct", "concise"}
    assert (reward.metadata["judge_valid"] == "false") == bool(invalid)
    assert judge.stats.judgements == 1 and judge.stats.invalid == (1 if invalid else 0)
    print("free-form:", reward.reason)


async def test_a_wrong_key_is_a_judge_error_not_a_zero(endpoint: tuple[str, list[dict[str, Any]]],
                                                       tmp_path: Path) -> None:
    from rlbus.errors import JudgeError

    url, _ = endpoint
    key = tmp_path / "judge.key"
    key.write_text("sk-wrong")
    judge = judge_for(judge_config(url, key))
    assert judge is not None
    try:
        with pytest.raises(JudgeError, match="HTTP 401"):
            await judge.score(answered("k", "42"), PROMPTS[0])
    finally:
        await judge.close()
