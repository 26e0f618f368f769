"""`Episode`: what one run of the agent loop produced, and its conversion to and from a `Rollout`.

An episode is a flat token sequence of length T covering every context segment in order. Token-aligned
lists (``loss_mask``, ``logprobs``, ``token_versions``) have length T; ``turns`` tile [0, T) exactly, each
turn's span including its role header, and carry their segment index.

Self-summarization splits an episode into segments, each a *fresh* context: segment k+1 does not attend
to segment k. A trainer recomputing log-probs must therefore run each segment separately —
`segment_spans` gives their [start, end) from the turns. The reward of the episode applies to every
segment's model tokens.

``routed_experts`` (MoE router replay) is one int16 array [L, T, k] aligned with the flat sequence; entry
t holds the experts token t was routed to as an *input* position. Every generation call re-reads its
context, so a position can be covered by several calls; the one kept is the call that sampled the next
token (the routing under which the trained log-prob was computed), and otherwise the latest call that
read the position. Positions never fed to the model (each segment's last token) hold -1.

This module imports neither torch nor an engine, so reward workers can rebuild episodes from rollouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.schemas import Prompt, Rollout, SamplingInfo, TensorData, Turn

FINISH_REASONS = ("stop", "max_turns", "length")


@dataclass
class Episode:
    """One agent episode; see the module docstring for the layout."""

    episode_id: str
    token_ids: list[int]
    loss_mask: list[int]
    """1 for model-sampled tokens (trained), 0 for prompt, headers, observations and summaries."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled token; 0.0 where the mask is 0."""
    token_versions: list[int]
    """Policy version that sampled each token; -1 where the mask is 0."""
    turns: list[Turn]
    finish_reason: str
    """``stop`` (answered), ``max_turns``, or ``length`` (token or context budget exhausted)."""
    answer: str | None = None
    routed_experts: np.ndarray[Any, Any] | None = None
    sampling: SamplingInfo = field(default_factory=SamplingInfo)
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    """Counters: ``turns``, ``tool_calls``, ``tool_errors``, ``malformed``, ``segments``."""
    metadata: dict[str, str] = field(default_factory=dict)
    """What the world reported at the end (`rlbus.envs.base.World.result`), carried in rollout metadata."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        lengths = {len(self.loss_mask), len(self.logprobs), len(self.token_versions)}
        if lengths != {n}:
            raise ValueError(f"token-aligned lists differ in length from token_ids ({n}): {sorted(lengths)}")
        if self.routed_experts is not None and self.routed_experts.shape[1] != n:
            raise ValueError(f"routed_experts covers {self.routed_experts.shape[1]} positions, not {n}")

    @property
    def segments(self) -> list[tuple[int, int]]:
        return segment_spans(self.turns)

    def model_text(self) -> str:
        """Everything the model wrote, turn by turn (for judges and logs)."""
        return "\n".join(t.text for t in self.turns if t.role == "assistant")


def segment_spans(turns: list[Turn]) -> list[tuple[int, int]]:
    """[start, end) of each context segment, in segment order."""
    spans: dict[int, tuple[int, int]] = {}
    for t in turns:
        lo, hi = spans.get(t.segment, (t.start, t.end))
        spans[t.segment] = (min(lo, t.start), max(hi, t.end))
    return [spans[k] for k in sorted(spans)]


def episode_to_rollout(
    episode: Episode,
    *,
    prompt: Prompt,
    group_index: int,
    model_id: str = "policy",
    worker_id: str = "",
    region: str = "",
    created_at: float | None = None,
) -> Rollout:
    """The `Rollout` message for an episode; the answer and counters travel in ``metadata``."""
    metadata = {**episode.metadata, "env": prompt.env, **{f"stat.{k}": str(v) for k, v in episode.stats.items()}}
    if episode.answer is not None:
        metadata["answer"] = episode.answer
    routed = episode.routed_experts
    return Rollout(
        rollout_id=episode.episode_id,
        prompt_id=prompt.prompt_id,
        group_index=group_index,
        group_size=prompt.group_size,
        model_id=model_id,
        worker_id=worker_id,
        region=region,
        token_ids=TensorData.from_numpy(np.asarray(episode.token_ids, dtype=np.int32)),
        loss_mask=TensorData.from_numpy(np.asarray(episode.loss_mask, dtype=np.uint8)),
        logprobs=TensorData.from_numpy(np.asarray(episode.logprobs, dtype=np.float32)),
        token_versions=TensorData.from_numpy(np.asarray(episode.token_versions, dtype=np.int32)),
        routed_experts=None if routed is None else TensorData.from_numpy(routed.astype(np.int16)),
        sampling=episode.sampling,
        turns=list(episode.turns),
        finish_reason=episode.finish_reason,
        timings=dict(episode.timings),
        created_at=time.time() if created_at is None else created_at,
        metadata=metadata,
        prompt=prompt,
    )


def rollout_to_episode(rollout: Rollout) -> Episode:
    """Rebuild the episode a rollout was made from (what reward workers score)."""
    stats = {k.removeprefix("stat."): int(v) for k, v in rollout.metadata.items() if k.startswith("stat.")}
    routed = rollout.routed_experts
    return Episode(
        episode_id=rollout.rollout_id,
        token_ids=rollout.token_ids.to_numpy().tolist(),
        loss_mask=rollout.loss_mask.to_numpy().tolist(),
        logprobs=rollout.logprobs.to_numpy().tolist(),
        token_versions=rollout.token_versions.to_numpy().tolist(),
        turns=list(rollout.turns),
        finish_reason=rollout.finish_reason,
        answer=rollout.metadata.get("answer"),
        routed_experts=None if routed is None else routed.to_numpy().copy(),
        sampling=rollout.sampling,
        timings=dict(rollout.timings),
        stats=stats,
        metadata={k: v for k, v in rollout.metadata.items() if not k.startswith("stat.") and k not in _OWN_KEYS},
    )


_OWN_KEYS = ("env", "answer")
