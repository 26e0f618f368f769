"""``Reward`` — a score for one rollout from one source.

Produced on ``rl.rewards.v1`` (key ``rollout_id``) by the reward workers (verifiers, sandboxed tests,
LM judges) and by ``producers/feedback.py`` (live users); consumed by the trainer, which joins rewards
with rollouts by ``rollout_id`` and waits for the sources its reward policy names.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from rlbus.schemas.base import Message

#: Metadata keys in which a reward reports reward hacking found in its rollout: ``hack_kinds``, the kinds an
#: environment's hack monitor found, comma-separated (``always_equal,exit``: rlbus/envs/swe/grading/monitor.py), and
#: ``tampered``, what a grader found changed in the test run it relied on (rlbus/envs/swe/grading/grade.py).
HACK_KINDS = "hack_kinds"
TAMPERED = "tampered"


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

    @property
    def hack_kinds(self) -> tuple[str, ...]:
        """The kinds of reward hacking this reward reports (its ``HACK_KINDS``, and ``tampered`` for a
        tampered test run), () when none: what the reward worker polices and counts and the trainer's
        ``hacked`` share counts, whichever environment scored the rollout."""
        kinds = [kind for kind in self.metadata.get(HACK_KINDS, "").split(",") if kind]
        if self.metadata.get(TAMPERED):
            kinds.append(TAMPERED)
        return tuple(dict.fromkeys(kinds))
