"""Streaming a completion as server-sent events: a role chunk per choice, text deltas as tokens are sampled,
the final chunk with the finish reason (and tool calls), optional usage, then ``data: [DONE]``.

Text is streamed only as far as it is safe: never past the start of a tool call or a stop string, never half
a UTF-8 character. A client that goes away mid-stream does not stop the generation or its recording.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web

from rlbus.engines.base import Engine, GenerationRequest, GenerationResult
from rlbus.envs.chat import ChatFormat
from rlbus.errors import ApiError
from rlbus.serve import api
from rlbus.serve.call import Call
from rlbus.serve.responses import headers, versions

log = logging.getLogger("rlbus.serve.gateway")  # a stream is one of the gateway's answers


async def stream_completion(
    http: web.Request, call: Call, *, engine: Engine, chat: ChatFormat, model_id: str,
    generate: Callable[[Sequence[GenerationRequest]], Awaitable[list[GenerationResult]]],
    finish: Callable[[Call, list[GenerationResult]], dict[str, Any]], clock: Callable[[], float],
) -> web.StreamResponse:
    """Server-sent events: a role chunk, text deltas as tokens are sampled, the finish, ``[DONE]``.

    A client that goes away mid-stream does not stop the generation or its recording: the tokens were
    sampled, so they are recorded (and join the session) like any completion."""
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers(call, None, engine.policy_version)})
    await response.prepare(http)
    created = int(clock())
    sink = Sink(response)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": call.served_id, "object": "chat.completion.chunk", "created": created,
                "model": call.request.model, "system_fingerprint": f"rlbus:{model_id}:v{version[0]}",
                "choices": choices, **extra}
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    version = [str(engine.policy_version)]
    n = len(call.engine_requests)
    for i in range(n):
        await sink.send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]))

    async def text(i: int, piece: str) -> None:
        await sink.send(chunk([{"index": i, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}]))

    try:
        results, sent = await stream_text(call, chat, generate, text)
    except Exception as exc:  # headers are out: the failure becomes the stream's last event
        await sink.fail(call, exc, lambda body: b"data: " + msgspec.json.encode(body) + b"\n\n")
        return response
    version[0] = versions(results, "v")
    body = finish(call, results)
    for i, choice in enumerate(body["choices"]):
        content = choice["message"]["content"] or ""
        delta: dict[str, Any] = {}
        if content.startswith(sent[i]) and len(content) > len(sent[i]):
            delta["content"] = content[len(sent[i]):]
        if "tool_calls" in choice["message"]:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(choice["message"]["tool_calls"])]
        await sink.send(chunk([{"index": i, "delta": delta, "logprobs": choice["logprobs"],
                                "finish_reason": choice["finish_reason"]}]))
    if call.request.stream_options is not None and call.request.stream_options.include_usage:
        await sink.send(chunk([], usage=body["usage"]))
    await sink.send(b"data: [DONE]\n\n")
    await sink.close()
    return response


class Sink:
    """Writes a stream's events; a client that went away is noted, never an error (generation goes on)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.gone = False

    async def send(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError):  # the client closed the connection
            self.gone = True

    async def close(self) -> None:
        if not self.gone:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.response.write_eof()

    async def fail(self, call: Call, exc: Exception, event: Callable[[dict[str, Any]], bytes]) -> None:
        """End the stream with the error as its last event (``event`` frames OpenAI's error body)."""
        log.exception("streamed completion %s failed", call.served_id)
        error = exc if isinstance(exc, ApiError) else ApiError(
            500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
        await self.send(event(api.error_body(error)))
        await self.close()


async def stream_text(
    call: Call, chat: ChatFormat,
    generate: Callable[[Sequence[GenerationRequest]], Awaitable[list[GenerationResult]]],
    text: Callable[[int, str], Awaitable[None]],
) -> tuple[list[GenerationResult], list[str]]:
    """Generate ``call``'s requests, handing ``text(i, piece)`` each new piece of choice ``i``'s reply as soon
    as it is safe to show (`safe_prefix`); returns the results and the text sent per choice."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    def pusher(i: int) -> Callable[[int], None]:
        def push(token: int) -> None:  # on the generating thread
            loop.call_soon_threadsafe(queue.put_nowait, (i, token))

        return push

    requests = [replace(r, on_token=pusher(i)) for i, r in enumerate(call.engine_requests)]
    tokens: list[list[int]] = [[] for _ in requests]
    sent = [""] * len(requests)
    holds = [*call.engine_requests[0].stop, *(["<tool_call>"] if call.tools else [])]
    generation = asyncio.ensure_future(generate(requests))
    while not (generation.done() and queue.empty()):
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait([getter, generation], return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            continue
        i, token = getter.result()
        tokens[i].append(token)
        visible = safe_prefix(chat.decode(tokens[i]), holds)
        if len(visible) > len(sent[i]) and visible.startswith(sent[i]):
            piece, sent[i] = visible[len(sent[i]):], visible
            await text(i, piece)
    return generation.result(), sent


def safe_prefix(text: str, holds: Sequence[str]) -> str:
    """The part of a partial reply safe to stream: before a tool call, without a partial UTF-8 character
    or a tail that may still become a stop string (which the final text would cut)."""
    if "<tool_call>" in holds and "<tool_call>" in text:
        text = text[: text.index("<tool_call>")]
    text = text.rstrip("\ufffd")
    for s in holds:
        if s in text:
            text = text[: text.index(s)]
    keep = len(text)
    for s in holds:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = min(keep, len(text) - k)
                break
    return text[:keep]
