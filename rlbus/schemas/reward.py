"""``Reward`` — a score for one rollout from one source.

Produced on ``rl.rewards.v1`` (key ``rollout_id``) by the reward workers (verifiers, sandboxed tests,
LM judges) and by ``producers/feedback.py`` (live users); consumed by the trainer, which joins rewards
with rollouts by ``rollout_id`` and waits for the sources its reward policy names.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from rlbus.schemas.base import Message


class Reward(Message, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_version: int = 1
    reward_id: str
    rollout_id: str
    prompt_id: str
    #: ``"verifier"``, ``"sandbox"``, ``"judge"``, ``"user"`` …
    source: str
    #: The scalar reward this source assigns.
    value: float
    #: Per-dimension scores (LM judge rubric dimensions, test pass counts …).
    components: dict[str, float] = msgspec.field(default_factory=dict)
    #: Why: verifier verdict, sandbox outcome, judge rationale, user comment.
    reason: str = ""
    created_at: float = 0.0
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    #: ``created_at`` of the rollout copy this reward scored (None: any copy, e.g. user feedback). A prompt
    #: redelivered after a crash is played again under the same rollout ids; the trainer's join pairs each
    #: reward with the copy it scored, never one copy's tokens with the other's reward.
    rollout_created_at: float | None = None
