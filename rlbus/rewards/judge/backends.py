"""The judge's models: the `JudgeBackend` contract and its two implementations.

`EngineJudge` runs any rlbus `Engine` locally (built from a `ModelSource` by `engine_judge`); `OpenAIJudge`
calls an OpenAI-compatible ``/v1/chat/completions`` endpoint over aiohttp, with a timeout per request and
retries with exponential backoff on connection errors, timeouts, 429 and 5xx (honouring ``Retry-After``).
An endpoint that stays down raises `JudgeUnavailable` (retriable), so an outage is never recorded as a
zero reward.
"""

from __future__ import annotations

import asyncio
import json
import random
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import aiohttp

from rlbus.envs.chat import ChatFormat
from rlbus.errors import JudgeError, JudgeUnavailable

if TYPE_CHECKING:
    from rlbus.engines.base import Engine
    from rlbus.models.sources import ModelSource

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class JudgeBackend(Protocol):
    """A chat model that answers one system + user message pair (at ``temperature``; None: its own)."""

    async def complete(self, system: str, user: str, *, temperature: float | None = None) -> str: ...


class EngineJudge:
    """A local judge: any rlbus `Engine` (blocking ``generate`` runs in a thread) and its chat format.

    The prompt is the template's own messages (system, user, then the generation prompt), contents encoded
    with special-token strings kept as text (`ChatFormat.encode`)."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        prefill: str = "",
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.prefill = prefill
        """Text the judge's reply starts with (``"SCORE: "``): the model writes the number straight away,
        on the one line the parser reads — how a small model (SmolLM2-135M) gives a readable score at all.
        The reply returned, and parsed, is the prefill plus what the model sampled, up to a newline."""

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The judge tokenizer's special-token strings (`escape_quoted` defuses them in quoted text)."""
        ids = getattr(self.chat.tokenizer, "special_ids", ())
        return tuple(sorted({self.chat.tokenizer.decode([i]) for i in ids}))

    async def complete(self, system: str, user: str, *, temperature: float | None = None) -> str:
        from rlbus.engines.base import GenerationRequest  # the engine's module pulls in torch

        c = self.chat
        ids = [*c.bos, *c.message_ids("system", system), *c.message_ids("user", user), *c.model_header]
        request = GenerationRequest(
            prompt_ids=(*ids, *c.encode(self.prefill)),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature if temperature is None else temperature,
            stop=("\n",) if self.prefill else (),
            stop_token_ids=c.stop_ids,
        )
        [result] = await asyncio.to_thread(self.engine.generate, [request])
        return self.prefill + c.decode(result.token_ids)


def engine_judge(
    source: ModelSource,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    prefill: str = "",
    seed: int = 0,
    max_batch: int = 16,
    engine: str = "torch",
) -> EngineJudge:
    """A judge on a bf16 copy of ``source`` (SmolLM2, any HF model, the policy) served by the engine kind
    ``engine`` (`rlbus.engines.kinds`; the torch engine by default), through its batching engine so the
    concurrent calls of several dimensions and rollouts share decode steps. Imports torch: only reward workers
    configured with an engine judge load it."""
    from rlbus.engines.kinds import engine_kind

    served = engine_kind(engine, field="reward.judge.engine").serve(source, seed=seed, max_batch=max_batch)
    return EngineJudge(served.batching, source.chat, max_new_tokens=max_new_tokens, temperature=temperature,
                       prefill=prefill)


class OpenAIJudge:
    """`JudgeBackend` over ``POST {base_url}/v1/chat/completions``; owns its aiohttp session unless given one."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        temperature: float = 0.0,
        max_tokens: int = 256,
        prefill: str = "",
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """``prefill``: the reply's start, sent as a final assistant message to continue (vLLM's
        ``continue_final_message``; the `EngineJudge.prefill` of an endpoint); "" sends none."""
        root = base_url.rstrip("/")
        self.url = root + ("/chat/completions" if root.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.prefill = prefill
        self._session = session
        self._owns_session = session is None
        self.attempts = 0
        """Requests sent so far, retries included."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def complete(self, system: str, user: str, *, temperature: float | None = None) -> str:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": self.temperature if temperature is None else temperature,
            "max_tokens": self.max_tokens,
        }
        if self.prefill:
            payload["messages"].append({"role": "assistant", "content": self.prefill})
            payload |= {"continue_final_message": True, "add_generation_prompt": False, "stop": ["\n"]}
        last: _Retry | None = None
        for attempt in range(self.retries + 1):
            if last is not None:
                await asyncio.sleep(self._delay(attempt, last.retry_after))
            try:
                return self.prefill + await self._post(payload)
            except _Retry as exc:
                last = exc
        raise JudgeUnavailable(f"judge endpoint {self.url} failed {self.retries + 1} times; last: {last}")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        base = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
        return base * random.uniform(0.5, 1.0)

    async def _post(self, payload: dict[str, Any]) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.attempts += 1
        try:
            async with self._client().post(self.url, json=payload, headers=headers, timeout=self.timeout) as resp:
                body = await resp.text()
                if resp.status in RETRY_STATUSES:
                    raise _Retry(f"HTTP {resp.status}", _retry_after(resp.headers.get("Retry-After")))
                if resp.status != 200:
                    raise JudgeError(f"judge endpoint {self.url} answered HTTP {resp.status}: {body[:300]}")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}", None) from exc
        return _completion_text(body)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session


class _Retry(Exception):
    def __init__(self, problem: str, retry_after: float | None) -> None:
        super().__init__(problem)
        self.retry_after = retry_after


def _retry_after(header: str | None) -> float | None:
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


def _completion_text(body: str) -> str:
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise JudgeError(f"not a chat completion ({type(exc).__name__}): {body[:300]}") from None
    if not isinstance(content, str):
        raise JudgeError(f"chat completion content is not text: {body[:300]}")
    return content
