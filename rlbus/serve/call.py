"""One chat-completion request as the gateway plays it: the rendered context, the engine requests built
from it, and how it is marked (a session's turn, a completion recorded as a rollout). The gateway builds
it (`rlbus.serve.gateway`); shaping the answer (`rlbus.serve.responses`), streaming it
(`rlbus.serve.streaming`) and recording it (`rlbus.serve.records`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbus.engines.base import GenerationRequest
from rlbus.serve import api
from rlbus.serve.prompt import Rendered
from rlbus.serve.sessions import Session

#: Marks a request as a turn of an agent session (its value: the session id).
SESSION_HEADER = "X-RL-Session"
#: Asks for a completion to be recorded as a rollout (``1``, ``true`` or ``yes``).
RECORD_HEADER = "X-RL-Record-Rollout"


@dataclass(frozen=True)
class Call:
    """One request as the gateway plays it: its context, its engine requests, how it is marked."""

    served_id: str
    request_id: str
    tenant: str
    request: api.ChatRequest
    context: Rendered
    engine_requests: list[GenerationRequest]
    tools: bool
    session: Session | None
    record_rollout: bool
    edits: list[str]
    started: float
    position: int = 0
    """The index the reply takes in the conversation (the number of messages sent): a session's key for it."""
    first_call_only: bool = False
    """``parallel_tool_calls: false`` under ``auto``: the engine stopped at the first ``</tool_call>``."""

    def rollout_ids(self) -> list[str]:
        """The ids of the rollouts a recorded completion becomes: the completion id, or ``<id>/<i>`` per choice."""
        n = self.request.n
        return [self.served_id] if n == 1 else [f"{self.served_id}/{i}" for i in range(n)]

    def prompt_id(self) -> str:
        """The prompt id of those rollouts: the completion id for a group of n > 1, else ``metadata.task``
        or the id."""
        if self.request.n > 1:
            return self.served_id
        return (self.request.metadata or {}).get("task") or self.served_id
