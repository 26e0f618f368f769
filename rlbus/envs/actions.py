"""What a model turn asks the harness to do, whatever syntax it was written in (tagged or native).

Both action formats — the byte model's tags (`rlbus.envs.chat.parse_action`) and chat templates' JSON
``<tool_call>`` blocks (`rlbus.envs.tool_calls.parse_native_action`) — parse into these three records, so
the agent loop handles one set of outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Malformed:
    """A turn with no complete action; ``problem`` is the observation the model gets back."""

    problem: str


Action = ToolCall | Answer | Malformed
