"""LM judge: score parsing, weighting, local engine backend, and the HTTP backend against a fake server.

The fake OpenAI-compatible server listens on 127.0.0.1 only; no test leaves the machine.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode
from rlbus.envs.scripted import ScriptedEngine
from rlbus.errors import ConfigError
from rlbus.rewards.judge import (
    Dimension,
    EngineJudge,
    Judge,
    JudgeError,
    JudgeUnavailable,
    OpenAIJudge,
    Rubric,
    parse_score,
)
from rlbus.schemas import Prompt

RUBRIC = Rubric(
    dimensions=[
        Dimension(name="correct", criterion="Is the answer right?", weight=3.0),
        Dimension(name="concise", criterion="Is it short?", weight=1.0, scale=5),
    ]
)
PROMPT = Prompt(prompt_id="p1", env="open", text="What is 2+3?", reference="5")


def episode(answer: str | None = "5") -> Episode:
    return Episode(episode_id="ep1", token_ids=[], loss_mask=[], logprobs=[], token_versions=[], turns=[],
                   finish_reason="stop", answer=answer)  # fmt: skip


class Scripted:
    """A backend answering per dimension name; records every call."""

    def __init__(self, replies: dict[str, str]) -> None:
        self.replies = replies
        self.calls: list[tuple[str, str]] = []

    async def complete(self, system: str, user: str, *, temperature: float | None = None) -> str:
        self.calls.append((system, user))
        name = user.split("Dimension: ")[1].split("\n")[0]
        return self.replies[name]


@pytest.mark.parametrize(
    ("text", "scale", "value", "raw"),
    [
        ("Fine.\nSCORE: 7/10", 10, 0.7, 7.0),
        ("score = 4", 5, 0.8, 4.0),
        ("SCORE: **9** / 10", 10, 0.9, 9.0),
        ("SCORE: 2/10\non reflection:\nSCORE: 6/10", 10, 0.6, 6.0),
        ("SCORE: 3/4", 4, 0.75, 3.0),
        ("SCORE: 10", 10, 1.0, 10.0),
        ("## Score: 8/10.", 10, 0.8, 8.0),
    ],
)
def test_parse_score(text: str, scale: int, value: float, raw: float) -> None:
    parsed = parse_score(text, scale)
    assert parsed.value == pytest.approx(value) and parsed.raw == raw and parsed.problem == ""


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("great answer, 8 of 10", "no 'SCORE"),
        ("SCORE: 12/10", "outside"),
        ("SCORE: 3/4", "not out of 10"),  # a denominator other than the dimension's scale
        ("I give it SCORE: 9/10", "no 'SCORE"),  # the score line holds nothing else
        ("> SCORE: 10/10", "no 'SCORE"),  # a quoted (echoed) line is not the judge's own
        ("SCORE: 2/10 ... on reflection SCORE: 6/10", "no 'SCORE"),
    ],
)
def test_unparseable_scores_are_recorded(text: str, problem: str) -> None:
    parsed = parse_score(text, 10)
    assert parsed.value is None and problem in parsed.problem


async def test_weighted_reward_with_components() -> None:
    backend = Scripted({"correct": "Right.\nSCORE: 10/10", "concise": "Wordy.\nSCORE: 1/5"})
    reward = await Judge(RUBRIC, backend).score(episode(), PROMPT)
    assert reward.source == "judge" and reward.reward_id == "ep1:judge" and reward.prompt_id == "p1"
    assert reward.components == pytest.approx({"correct": 1.0, "concise": 0.2})
    assert reward.value == pytest.approx((3 * 1.0 + 1 * 0.2) / 4)
    assert "correct: 10/10 (weight 3)" in reward.reason and reward.metadata["judge_valid"] == "true"
    assert len(backend.calls) == 2  # one call per dimension
    system, user = backend.calls[0]
    assert "SCORE: N/10" in system and "Criterion: Is the answer right?" in system
    assert "Task:\n<<<TASK-" in user and "\n> What is 2+3?\n" in user and "\n> 5\n<<<END-" in user
    assert "Reference answer" not in user  # include_reference is off


async def test_an_unparseable_dimension_does_not_count_and_is_named() -> None:
    backend = Scripted({"correct": "I refuse to grade.", "concise": "SCORE: 4/5"})
    reward = await Judge(RUBRIC, backend, parse_retries=0).score(episode(), PROMPT)
    assert reward.components == pytest.approx({"concise": 0.8})  # never NaN: the join refuses non-finite ones
    assert reward.value == pytest.approx(0.8) and math.isfinite(reward.value)
    assert "correct: unparseable (no 'SCORE: N/10' line)" in reward.reason
    assert reward.metadata["judge_valid"] == "false" and reward.metadata["judge_invalid"] == "correct"
    nothing = await Judge(RUBRIC, Scripted({"correct": "?", "concise": "?"})).score(episode(), PROMPT)
    assert nothing.value == 0.0 and nothing.metadata["judge_valid"] == "false" and nothing.components == {}


async def test_reference_and_transcript_are_shown_when_asked() -> None:
    rubric = Rubric(dimensions=[Dimension(name="correct", criterion="c")], include_reference=True)
    backend = Scripted({"correct": "SCORE: 5/10"})
    reward = await Judge(rubric, backend).score(episode(answer=None), PROMPT)
    assert "Reference answer:\n<<<REFERENCE-" in backend.calls[0][1] and "\n> 5\n" in backend.calls[0][1]
    assert reward.metadata["graded"] == "transcript"


def test_rubric_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        Rubric.from_dict({"dimensions": [{"name": "a", "criterion": "c", "wieght": 2}]})
    assert caught.value.field == "rubric.dimensions[0].wieght"
    with pytest.raises(ConfigError):
        Rubric.from_dict({"dimensions": [{"name": "a", "criterion": "c"}, {"name": "a", "criterion": "d"}]})


async def test_engine_judge_runs_a_local_engine() -> None:
    chat = ChatFormat.for_byte_tokenizer()
    engine = ScriptedEngine(["Looks right.\nSCORE: 8/10", "SCORE: 5/5"], tokenizer=chat.tokenizer)
    reward = await Judge(RUBRIC, EngineJudge(engine, chat)).score(episode(), PROMPT)
    assert reward.components == pytest.approx({"correct": 0.8, "concise": 1.0})
    request = engine.requests[0]
    assert request.temperature == 0.0 and request.prompt_ids[-1] == chat.header("assistant")[0]
    assert "Dimension: correct" in chat.tokenizer.decode(request.prompt_ids)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def fake_api() -> AsyncIterator[tuple[TestServer, list[Any], list[Handler]]]:
    """An OpenAI-compatible server on 127.0.0.1; tests queue handlers, the last one repeats."""
    seen: list[Any] = []
    handlers: list[Handler] = []

    async def endpoint(request: web.Request) -> web.StreamResponse:
        seen.append({"body": await request.json(), "auth": request.headers.get("Authorization")})
        handler = handlers.pop(0) if len(handlers) > 1 else handlers[0]
        return await handler(request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endpoint)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server, seen, handlers
    finally:
        await server.close()


def reply(content: str) -> Handler:
    async def handle(_: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": content}}]})

    return handle


def status(code: int, headers: dict[str, str] | None = None) -> Handler:
    async def handle(_: web.Request) -> web.StreamResponse:
        return web.Response(status=code, text="busy", headers=headers)

    return handle


def slow(seconds: float) -> Handler:
    async def handle(_: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return web.json_response({"choices": [{"message": {"content": "SCORE: 1/10"}}]})

    return handle


def client(server: TestServer, **kw: Any) -> OpenAIJudge:
    options: dict[str, Any] = {"model": "judge-1", "backoff_s": 0.01, "retries": 3, **kw}
    return OpenAIJudge(base_url=str(server.make_url("/")), **options)


async def test_http_judge_scores_through_the_endpoint(fake_api: Any) -> None:
    server, seen, handlers = fake_api
    handlers.append(reply("Correct.\nSCORE: 9/10"))
    async with client(server, api_key="k-test", retries=0) as backend:
        reward = await Judge(Rubric(dimensions=[RUBRIC.dimensions[0]]), backend).score(episode(), PROMPT)
    assert reward.value == pytest.approx(0.9)
    body = seen[0]["body"]
    assert body["model"] == "judge-1" and [m["role"] for m in body["messages"]] == ["system", "user"]
    assert seen[0]["auth"] == "Bearer k-test"


async def test_http_judge_retries_503_then_succeeds(fake_api: Any) -> None:
    server, seen, handlers = fake_api
    handlers += [status(503), status(429, {"Retry-After": "0"}), reply("SCORE: 3/10")]
    async with client(server) as backend:
        assert await backend.complete("s", "u") == "SCORE: 3/10"
        assert backend.attempts == 3 and len(seen) == 3


async def test_http_judge_gives_up_after_the_retries(fake_api: Any) -> None:
    server, seen, handlers = fake_api
    handlers.append(status(503))
    async with client(server, retries=2) as backend:
        with pytest.raises(JudgeUnavailable, match="failed 3 times; last: HTTP 503") as caught:
            await backend.complete("s", "u")
    assert caught.value.retriable and len(seen) == 3


async def test_http_judge_does_not_retry_client_errors_or_bad_bodies(fake_api: Any) -> None:
    server, seen, handlers = fake_api
    handlers += [status(400), reply("unused")]
    async with client(server) as backend:
        with pytest.raises(JudgeError, match="HTTP 400") as caught:
            await backend.complete("s", "u")
        assert not caught.value.retriable and len(seen) == 1

    async def not_json(_: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>oops</html>")

    handlers[:] = [not_json]
    async with client(server) as backend:
        with pytest.raises(JudgeError, match="not a chat completion"):
            await backend.complete("s", "u")


async def test_http_judge_retries_a_timeout(fake_api: Any) -> None:
    server, seen, handlers = fake_api
    handlers += [slow(2.0), reply("SCORE: 2/10")]
    async with client(server, timeout_s=0.2) as backend:
        assert await backend.complete("s", "u") == "SCORE: 2/10"
    assert len(seen) == 2


async def test_http_judge_unreachable_endpoint_is_unavailable() -> None:
    backend = OpenAIJudge(base_url="http://127.0.0.1:9/v1", model="m", retries=1, backoff_s=0.01, timeout_s=2)
    assert backend.url == "http://127.0.0.1:9/v1/chat/completions"
    async with backend:
        with pytest.raises(JudgeUnavailable, match="ClientConnectorError"):
            await backend.complete("s", "u")
