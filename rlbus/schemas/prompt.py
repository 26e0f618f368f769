"""``Prompt`` — one task handed to the rollout workers, asking for a group of G rollouts.

Produced by ``producers/prompts.py`` on ``rl.prompts.v1`` (key ``prompt_id``); consumed by
``consumers/rollout.py`` (the rollout group) and read by the trainer for group bookkeeping.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from rlbus.schemas.base import Message


class Prompt(Message, kw_only=True):
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_version: int = 1
    #: Unique id; also the Kafka key, so every rollout of the group lands in one partition.
    prompt_id: str
    #: Registered environment name that runs the episode (e.g. ``"arith"``, ``"python_fn"``).
    env: str
    #: The task statement shown to the model.
    text: str
    #: Environment configuration as data (tools enabled, limits, hidden tests …).
    env_config: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Number of rollouts the group needs (GRPO G).
    group_size: int = 8
    #: Reference answer for verifiers and warm start; never shown to the model.
    reference: str | None = None
    #: Trainer version when the prompt was admitted (admission control bounds staleness with it).
    policy_version: int = 0
    #: Unix seconds at production.
    created_at: float = 0.0
    #: Free-form string tags (dataset, split, region hint …).
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
