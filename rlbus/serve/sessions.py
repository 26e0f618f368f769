"""Agent sessions: an external harness's multi-turn conversation, kept token-exact, closed into one rollout.

A client marks a session with the ``X-RL-Session: <id>`` header (or, failing that, the ``user`` field
when the gateway is configured to treat it as one). The gateway keeps every turn it sampled for the
session (`rlbus.serve.prompt.SampledTurn`); when the client sends the conversation back, the earlier
assistant messages are mapped to those ids (`rlbus.serve.prompt.render`) and the session's sequence is
the last context plus the last turn: the prompt and observations masked, every sampled id with loss
mask 1, its log-prob and its policy version. This is AReaL's "online proxy" mode (Fu et al., 2025) —
an agent harness the trainer does not own, trained on exactly what was sampled.

``POST /rl/sessions/{id}/reward`` closes the session: the sequence becomes one `Rollout`
(:meth:`Session.rollout`, group of one) and the body's value one `Reward`, both published for the
trainer's join. A session is per gateway process and in memory (its turns are also on ``rl.served.v1``,
keyed by session id): replicas behind a load balancer need session affinity on the header. Sessions
idle for ``ttl_s`` are forgotten, counted as expired.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.errors import ApiError
from rlbus.metrics import SERVE_SESSIONS_OPEN
from rlbus.schemas import Reward, Rollout, SamplingInfo, TensorData
from rlbus.serve.prompt import Rendered, SampledTurn


@dataclass
class Session:
    session_id: str
    tenant: str
    task: str
    """The rollout's prompt_id: the client's ``metadata.task``, else the session id."""
    created_at: float
    last_active: float
    turns: dict[str, SampledTurn] = field(default_factory=dict)
    sequence: Rendered | None = None
    """The newest context plus the turn sampled after it."""
    request_ids: list[str] = field(default_factory=list)
    sampling: SamplingInfo = field(default_factory=SamplingInfo)
    finish_reason: str = "stop"
    edits: int = 0
    closing: bool = False

    @property
    def oldest_version(self) -> int | None:
        """Oldest policy version among the sampled tokens of the current sequence."""
        if self.sequence is None:
            return None
        sampled = [v for v, m in zip(self.sequence.versions, self.sequence.mask, strict=True) if m]
        return min(sampled) if sampled else None

    def add_turn(self, context: Rendered, turn: SampledTurn, *, header_len: int, closing: list[int],
                 sampling: SamplingInfo, request_id: str, now: float) -> None:
        """Record the turn just sampled after ``context`` (which ends with the ``header_len`` ids of the
        generation prompt the turn opened with)."""
        sequence = context.copy()
        start = len(sequence.ids) - header_len
        sequence.add_sampled(turn.token_ids, turn.logprobs, turn.versions)
        sequence.add(closing)
        sequence.mapped.append(turn)
        sequence.turn("assistant", turn.text, start)
        self.sequence = sequence
        self.turns[turn.key] = turn
        self.sampling = sampling
        self.finish_reason = turn.finish_reason
        self.request_ids.append(request_id)
        self.last_active = now

    def rollout(self, *, model_id: str, worker_id: str, region: str, now: float) -> Rollout:
        """The session as one rollout (group of one), per the gateway's contract."""
        seq = self.sequence
        if seq is None or not any(seq.mask):
            raise ApiError(409, f"session {self.session_id!r} has no sampled turn to train on",
                           param="session_id", code="session_empty")
        return Rollout(
            rollout_id=self.session_id,
            prompt_id=self.task,
            group_index=0,
            group_size=1,
            model_id=model_id,
            worker_id=worker_id,
            region=region,
            token_ids=TensorData.from_numpy(np.asarray(seq.ids, dtype=np.int32)),
            loss_mask=TensorData.from_numpy(np.asarray(seq.mask, dtype=np.uint8)),
            logprobs=TensorData.from_numpy(np.asarray(seq.logprobs, dtype=np.float32)),
            token_versions=TensorData.from_numpy(np.asarray(seq.versions, dtype=np.int32)),
            routed_experts=_routing(seq.mapped, len(seq.ids)),
            sampling=self.sampling,
            turns=list(seq.turns),
            finish_reason=self.finish_reason,
            timings={"session_s": now - self.created_at},
            created_at=now,
            metadata={
                "origin": "served", "tenant": self.tenant, "session_id": self.session_id,
                "request_ids": ",".join(self.request_ids), "history_edits": str(self.edits),
            },
        )


def _routing(turns: list[SampledTurn], total: int) -> TensorData | None:
    """[L, T, k] experts per input position (rule of `rlbus.envs.episode`): every mapped turn's prompt is a
    prefix of the sequence (the mapping checks it), so its experts cover positions [0, P + N - 1); the
    positions whose next token a turn sampled take that turn's routing."""
    calls = [t for t in turns if t.routed_experts is not None]
    if not calls or len(calls) != len(turns):
        return None
    layers, k = calls[0].routed_experts.shape[0], calls[0].routed_experts.shape[2]  # type: ignore[union-attr]
    out = np.full((layers, total, k), -1, dtype=np.int16)
    for t in calls:
        e = t.routed_experts
        assert e is not None
        out[:, : e.shape[1]] = e
    for t in calls:
        e = t.routed_experts
        assert e is not None
        own = slice(len(t.prompt_ids) - 1, len(t.prompt_ids) + len(t.token_ids) - 1)
        out[:, own] = e[:, own]
    return TensorData.from_numpy(out)


#: The range of a session's reward: the scale of every reward source (verifiers score 1 or 0, user thumbs
#: 1 or 0, judges [0, 1]) and of the online lane's baseline (``baseline_init`` 0.5 is neutral).
REWARD_RANGE = (0.0, 1.0)


def session_reward(session: Session, body: dict[str, Any], *, now: float) -> Reward:
    """The `Reward` a close request's body becomes (source ``user`` unless it names another). The reward is
    a finite number in `REWARD_RANGE`: anything else is refused (400) before the session is closed — a
    NaN or a 1e9 would otherwise reach the trainer (a dead letter there, or an advantage of 1e9)."""
    value = body.get("reward", body.get("value"))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, "reward: a number is required", param="reward", code="invalid_value")
    lo, hi = REWARD_RANGE
    if not lo <= value <= hi:  # NaN compares false too
        raise ApiError(400, f"reward: {str(value)[:32]} is not a number in [{lo:g}, {hi:g}] (1 good, 0 bad)",
                       param="reward", code="invalid_value")
    source = body.get("source", "user")
    if not isinstance(source, str) or not source:
        raise ApiError(400, "source: a non-empty string", param="source", code="invalid_value")
    components = body.get("components", {})
    if not isinstance(components, dict) or not all(_finite(v) for v in components.values()):
        raise ApiError(400, "components: an object of finite numbers", param="components", code="invalid_value")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        raise ApiError(400, "reason: a string", param="reason", code="invalid_value")
    unknown = set(body) - {"reward", "value", "source", "components", "reason"}
    if unknown:
        raise ApiError(400, f"unknown field {sorted(unknown)[0]!r}", param=sorted(unknown)[0], code="unknown_parameter")
    return Reward(
        reward_id=f"{session.session_id}:{source}:session",
        rollout_id=session.session_id,
        prompt_id=session.task,
        source=source,
        value=float(value),
        components={k: float(v) for k, v in components.items()},
        reason=reason,
        created_at=now,
        metadata={"origin": "served", "tenant": session.tenant, "session_id": session.session_id},
    )


def _finite(v: Any) -> bool:
    """A JSON number that is a finite float (not a bool, not NaN or ±inf, not an int beyond a float's range)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class Sessions:
    """The open sessions of one gateway: at most ``max_open``; idle ones expire after ``ttl_s``."""

    def __init__(
        self, *, max_open: int = 10_000, ttl_s: float = 3600.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.max_open = max_open
        self.ttl_s = ttl_s
        self._clock = clock
        self._open: dict[str, Session] = {}
        self.closed = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._open)

    def get(self, session_id: str) -> Session | None:
        self._expire()
        return self._open.get(session_id)

    def open(self, session_id: str, *, tenant: str, task: str | None) -> Session:
        """The session ``session_id`` of ``tenant``, created on first use. Another tenant's id is a 404."""
        self._expire()
        session = self._open.get(session_id)
        if session is not None:
            if session.tenant != tenant:
                raise ApiError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
            return session
        now = self._clock()
        session = Session(session_id=session_id, tenant=tenant, task=task or session_id, created_at=now,
                          last_active=now)
        self._open[session_id] = session
        SERVE_SESSIONS_OPEN.set(len(self._open))
        return session

    def owned(self, session_id: str, tenant: str) -> Session:
        session = self.get(session_id)
        if session is None or session.tenant != tenant:
            raise ApiError(404, f"no open session {session_id!r}", param="session_id", code="session_not_found")
        return session

    def close(self, session_id: str) -> None:
        if self._open.pop(session_id, None) is not None:
            self.closed += 1
        SERVE_SESSIONS_OPEN.set(len(self._open))

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        for sid in [s for s, session in self._open.items() if session.last_active < horizon and not session.closing]:
            del self._open[sid]
            self.expired += 1
        SERVE_SESSIONS_OPEN.set(len(self._open))
