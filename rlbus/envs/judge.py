"""LM judges: a rubric split into weighted dimensions, one structured judge call per dimension.

Judges are the second kind of reward (DESIGN §6), for what no verifier can check. Asking for one overall
grade mixes criteria and is noisy; asking one question per dimension ("is it correct?", "is it concise?")
gives scores that can be read, weighted and audited separately. Each call ends with a line
``SCORE: N/10`` that `parse_score` reads; a reply without a readable score is recorded as unparseable
(NaN in ``Reward.components``, named in ``reason``), never a crash and never a silent zero.

Reward: ``components[dimension]`` is that dimension's score normalised to [0, 1] (NaN if unparseable);
``value`` is the weighted mean over the parsed dimensions, so a judge that failed to answer on one
dimension does not drag the total down. If no dimension parsed, ``value`` is 0.0 and
``metadata["judge_valid"]`` is ``"false"`` so the trainer's reward policy can drop it.

The judge model is pluggable (`JudgeBackend`): `EngineJudge` runs any rlbus `Engine` locally;
`OpenAIJudge` calls an OpenAI-compatible ``/v1/chat/completions`` endpoint over aiohttp with a timeout per
request and retries with exponential backoff on connection errors, timeouts, 429 and 5xx (honouring
``Retry-After``). An endpoint that stays down raises `JudgeUnavailable` (retriable): a judge outage must
not be recorded as a zero reward.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import aiohttp
import msgspec

from rlbus.config import parse
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode
from rlbus.envs.rewards import make_reward
from rlbus.errors import JudgeError, JudgeUnavailable
from rlbus.schemas import Prompt, Reward

if TYPE_CHECKING:
    from rlbus.engines.base import Engine

_SCORE = re.compile(r"SCORE\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

SYSTEM_PROMPT = (
    "You are a careful, strict grader. You grade one dimension of a response to a task. "
    "Explain briefly, then end with a line of the form 'SCORE: N/{scale}'."
)


class Dimension(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One graded aspect of a response."""

    name: str
    """Key of the score in ``Reward.components``."""
    criterion: str
    """What the judge checks, as a question or statement."""
    weight: float = 1.0
    """Relative weight in the total; > 0."""
    scale: int = 10
    """Scores run from 0 to ``scale``."""

    def __post_init__(self) -> None:
        if not self.name or self.weight <= 0 or self.scale < 1:
            raise ValueError("name must be non-empty, weight > 0 and scale ≥ 1")


class Rubric(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The dimensions a response is graded on."""

    dimensions: list[Dimension]
    """At least one, with distinct names."""
    include_reference: bool = False
    """Show the judge the prompt's reference answer."""

    def __post_init__(self) -> None:
        names = [d.name for d in self.dimensions]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"dimensions must be non-empty with distinct names, got {names}")

    @classmethod
    def from_dict(cls, data: Any) -> Rubric:
        """Validate a rubric given as data; errors name the field (``rubric.dimensions[0].weight``)."""
        rubric: Rubric = parse(cls, data, prefix="rubric")
        return rubric


@dataclass(frozen=True)
class ParsedScore:
    """A judge reply's score: ``value`` in [0, 1], or None with ``problem`` saying why."""

    value: float | None
    raw: float | None
    problem: str = ""


def parse_score(text: str, scale: int) -> ParsedScore:
    """Read the last ``SCORE: N`` or ``SCORE: N/M`` of a reply (M defaults to ``scale``)."""
    matches = _SCORE.findall(text)
    if not matches:
        return ParsedScore(None, None, f"no 'SCORE: N/{scale}' line")
    number, denominator = matches[-1]
    raw, top = float(number), float(denominator) if denominator else float(scale)
    if top <= 0 or not 0 <= raw <= top:
        return ParsedScore(None, raw, f"score {number} outside 0..{top:g}")
    return ParsedScore(raw / top, raw)


class JudgeBackend(Protocol):
    """A chat model that answers one system + user message pair."""

    async def complete(self, system: str, user: str) -> str: ...


@dataclass(frozen=True)
class DimensionScore:
    dimension: Dimension
    score: ParsedScore
    reply: str


class Judge:
    """Grades responses on a rubric with one backend call per dimension, concurrently."""

    def __init__(self, rubric: Rubric, backend: JudgeBackend, *, source: str = "judge") -> None:
        self.rubric = rubric
        self.backend = backend
        self.source = source

    async def grade(self, *, task: str, response: str, reference: str | None = None) -> list[DimensionScore]:
        shown = reference if self.rubric.include_reference else None
        calls = [self._grade_one(d, task, response, shown) for d in self.rubric.dimensions]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [r for r in results if isinstance(r, DimensionScore)]

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        """The episode's reward: its answer (or, without one, everything the model wrote) graded."""
        response = episode.answer if episode.answer is not None else episode.model_text()
        scores = await self.grade(task=prompt.text, response=response, reference=prompt.reference)
        value, components, reason, metadata = combine(scores)
        metadata["graded"] = "answer" if episode.answer is not None else "transcript"
        return make_reward(episode, prompt, source=self.source, value=value, reason=reason,
                           components=components, metadata=metadata)  # fmt: skip

    async def _grade_one(self, d: Dimension, task: str, response: str, reference: str | None) -> DimensionScore:
        system, user = judge_messages(d, task=task, response=response, reference=reference)
        reply = await self.backend.complete(system, user)
        return DimensionScore(d, parse_score(reply, d.scale), reply)


def judge_messages(d: Dimension, *, task: str, response: str, reference: str | None = None) -> tuple[str, str]:
    """The (system, user) messages of one dimension's judge call."""
    parts = [f"Task:\n{task}", f"Response:\n{response}"]
    if reference is not None:
        parts.append(f"Reference answer:\n{reference}")
    parts.append(f"Dimension: {d.name}\nCriterion: {d.criterion}")
    parts.append(f"Give an integer N from 0 (worst) to {d.scale} (best) and end with 'SCORE: N/{d.scale}'.")
    return SYSTEM_PROMPT.format(scale=d.scale), "\n\n".join(parts)


def combine(scores: Sequence[DimensionScore]) -> tuple[float, dict[str, float], str, dict[str, str]]:
    """(weighted total over parsed dimensions, per-dimension components, reason, metadata)."""
    components = {s.dimension.name: s.score.value if s.score.value is not None else math.nan for s in scores}
    parsed = [s for s in scores if s.score.value is not None]
    weight = sum(s.dimension.weight for s in parsed)
    value = sum(s.dimension.weight * (s.score.value or 0.0) for s in parsed) / weight if parsed else 0.0
    reason = "; ".join(_describe(s) for s in scores)
    metadata = {"judge_valid": "true" if parsed else "false"}
    metadata |= {f"reply.{s.dimension.name}": s.reply[-500:] for s in scores}
    return value, components, reason, metadata


def _describe(s: DimensionScore) -> str:
    if s.score.value is None:
        return f"{s.dimension.name}: unparseable ({s.score.problem})"
    return f"{s.dimension.name}: {s.score.raw:g}/{s.dimension.scale} (weight {s.dimension.weight:g})"


class EngineJudge:
    """A local judge: any rlbus `Engine` (blocking ``generate`` runs in a thread) and its chat format."""

    def __init__(
        self, engine: Engine, chat: ChatFormat, *, max_new_tokens: int = 128, temperature: float = 0.0
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature

    async def complete(self, system: str, user: str) -> str:
        from rlbus.engines.base import GenerationRequest  # the engine's module pulls in torch

        c = self.chat
        ids = [*c.bos, *c.header("system"), *c.encode(system), *c.header("user"), *c.encode(user)]
        request = GenerationRequest(
            prompt_ids=(*ids, *c.header("assistant")),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            stop_token_ids=(c.eos_id,),
        )
        [result] = await asyncio.to_thread(self.engine.generate, [request])
        return c.decode(result.token_ids)


class HttpJudgeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="http",
                      tag_field="kind"):  # fmt: skip
    """An OpenAI-compatible chat completions endpoint as the judge."""

    base_url: str
    """Server root (``http://host:8000``) or its ``/v1`` path."""
    model: str
    """Model name sent in each request."""
    api_key: str | None = None
    """Bearer token, if the endpoint needs one."""
    timeout_s: float = 60.0
    """Limit on one request, connection included."""
    retries: int = 4
    """Further attempts after a retriable failure."""
    backoff_s: float = 0.5
    """First retry delay; doubles per attempt, with jitter."""
    max_backoff_s: float = 8.0
    """Upper bound of one retry delay (Retry-After included)."""
    temperature: float = 0.0
    max_tokens: int = 256
    """Tokens the judge may write per dimension."""


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
        session: aiohttp.ClientSession | None = None,
    ) -> None:
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

    async def complete(self, system: str, user: str) -> str:
        payload = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        last: _Retry | None = None
        for attempt in range(self.retries + 1):
            if last is not None:
                await asyncio.sleep(self._delay(attempt, last.retry_after))
            try:
                return await self._post(payload)
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


def http_judge(config: HttpJudgeConfig) -> OpenAIJudge:
    """Build the HTTP judge backend from its config."""
    return OpenAIJudge(
        base_url=config.base_url,
        model=config.model,
        api_key=config.api_key,
        timeout_s=config.timeout_s,
        retries=config.retries,
        backoff_s=config.backoff_s,
        max_backoff_s=config.max_backoff_s,
        temperature=config.temperature,
        max_tokens=config.max_tokens,
    )


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
