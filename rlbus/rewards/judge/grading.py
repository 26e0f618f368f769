"""The judge: one backend call per rubric dimension, retried when the reply has no readable score, and the
parsed dimensions combined into one `Reward` (see the package docstring, `rlbus.rewards.judge`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rlbus.envs.episode import Episode
from rlbus.envs.scoring import make_reward
from rlbus.metrics import JUDGE_INVALID, JUDGE_RETRIES, JUDGE_SECONDS
from rlbus.rewards.judge.backends import JudgeBackend
from rlbus.rewards.judge.parse import ParsedScore, parse_score
from rlbus.rewards.judge.prompt import judge_messages, new_nonce
from rlbus.rewards.judge.rubric import Dimension, Rubric
from rlbus.schemas import Prompt, Reward


@dataclass(frozen=True)
class DimensionScore:
    dimension: Dimension
    score: ParsedScore
    reply: str
    attempts: int = 1


@dataclass
class JudgeStats:
    """What a judge has done so far (the reward worker's heartbeat carries it to the dashboard)."""

    judgements: int = 0
    invalid: int = 0
    calls: int = 0
    retries: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        n = max(self.judgements, 1)
        return {"judge_judgements": self.judgements, "judge_invalid": self.invalid, "judge_retries": self.retries,
                "judge_invalid_rate": self.invalid / n, "judge_latency_s": self.seconds / n}


class Judge:
    """Grades responses on a rubric with one backend call per dimension, concurrently; an unreadable reply
    is asked again up to ``parse_retries`` times at ``retry_temperature``."""

    def __init__(
        self,
        rubric: Rubric,
        backend: JudgeBackend,
        *,
        source: str = "judge",
        parse_retries: int = 2,
        retry_temperature: float = 0.7,
        specials: Iterable[str] = (),
        nonce: Callable[[], str] = new_nonce,
    ) -> None:
        if parse_retries < 0:
            raise ValueError("parse_retries must be ≥ 0")
        self.rubric = rubric
        self.backend = backend
        self.source = source
        self.parse_retries = parse_retries
        self.retry_temperature = retry_temperature
        self.specials = tuple(specials) or tuple(getattr(backend, "special_tokens", ()))
        self.nonce = nonce
        self.stats = JudgeStats()

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
        start = time.perf_counter()
        scores = await self.grade(task=prompt.text, response=response, reference=prompt.reference)
        elapsed = time.perf_counter() - start
        value, components, reason, metadata = combine(scores)
        retries = sum(s.attempts - 1 for s in scores)
        metadata |= {"graded": "answer" if episode.answer is not None else "transcript",
                     "judge_retries": str(retries), "judge_seconds": f"{elapsed:.3f}"}
        self._count(metadata["judge_valid"] == "true", retries, len(scores) + retries, elapsed)
        return make_reward(episode, prompt, source=self.source, value=value, reason=reason,
                           components=components, metadata=metadata)  # fmt: skip

    def _count(self, valid: bool, retries: int, calls: int, elapsed: float) -> None:
        self.stats.judgements += 1
        self.stats.invalid += 0 if valid else 1
        self.stats.retries += retries
        self.stats.calls += calls
        self.stats.seconds += elapsed
        JUDGE_SECONDS.labels(self.source).observe(elapsed)
        if retries:
            JUDGE_RETRIES.labels(self.source).inc(retries)
        if not valid:
            JUDGE_INVALID.labels(self.source).inc()

    async def _grade_one(self, d: Dimension, task: str, response: str, reference: str | None) -> DimensionScore:
        for attempt in range(1, self.parse_retries + 2):
            system, user = judge_messages(d, task=task, response=response, reference=reference,
                                          nonce=self.nonce(), instructions=self.rubric.instructions,
                                          specials=self.specials)  # fmt: skip
            temperature = None if attempt == 1 else self.retry_temperature
            reply = await self.backend.complete(system, user, temperature=temperature)
            parsed = parse_score(reply, d.scale)
            if parsed.value is not None or attempt > self.parse_retries:
                return DimensionScore(d, parsed, reply, attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Close the backend's resources (an HTTP session), if it has any."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            await close()


def combine(scores: Sequence[DimensionScore]) -> tuple[float, dict[str, float], str, dict[str, str]]:
    """(weighted total over parsed dimensions, their components, reason, metadata); see the module docstring."""
    parsed = [s for s in scores if s.score.value is not None]
    components = {s.dimension.name: float(s.score.value) for s in parsed if s.score.value is not None}
    weight = sum(s.dimension.weight for s in parsed)
    value = sum(s.dimension.weight * (s.score.value or 0.0) for s in parsed) / weight if parsed else 0.0
    reason = "; ".join(_describe(s) for s in scores)
    invalid = [s.dimension.name for s in scores if s.score.value is None]
    metadata = {"judge_valid": "false" if invalid else "true"}
    if invalid:
        metadata["judge_invalid"] = ",".join(invalid)
    metadata |= {f"reply.{s.dimension.name}": s.reply[-500:] for s in scores}
    return value, components, reason, metadata


def is_valid(reward: Reward) -> bool:
    """Whether a reward is not an invalid judgement (`combine`); rewards of other sources always are."""
    return reward.metadata.get("judge_valid") != "false"


def _describe(s: DimensionScore) -> str:
    tries = f" after {s.attempts} tries" if s.attempts > 1 else ""
    if s.score.value is None:
        return f"{s.dimension.name}: unparseable ({s.score.problem}){tries}"
    return f"{s.dimension.name}: {s.score.raw:g}/{s.dimension.scale} (weight {s.dimension.weight:g}){tries}"
