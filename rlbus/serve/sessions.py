"""Agent sessions: an external harness's multi-turn conversation, kept token-exact, closed into one rollout.

A client marks a session with the ``X-RL-Session: <id>`` header (or, failing that, the ``user`` field
when the gateway is configured to treat it as one). The gateway keeps every turn it sampled for the
session (`rlbus.serve.prompt.SampledTurn`), by its **position** in the conversation; when the client sends
the conversation back, the earlier assistant messages are mapped to those ids (`rlbus.serve.prompt.render`).
This is AReaL's "online proxy" mode (Fu et al., 2025) — an agent harness the trainer does not own, trained
on exactly what was sampled.

``POST /rl/sessions/{id}/reward`` closes the session into one `Rollout` (:meth:`Session.rollout`, group of
one) holding **every turn the session sampled**, each under the context it was sampled in: the newest
turn's sequence (its context, with every earlier turn it maps to as sampled, and the turn), then, for each
sampled turn that sequence does not contain, that turn's own sequence as a further context segment
(`rlbus.schemas.Turn.segment`: the trainer runs each segment as its own row, as for a self-summarising
episode). Prompts and observations are masked; every sampled id has loss mask 1, its log-prob, its policy
version and, when it was constrained, its allowed-token mask. What that means for each way a client may
treat its history:

* **Sent back as returned**: one segment, every turn mapped (``X-RL-History: ok``).
* **Identical replies** (an agent repeating a tool call): each is recorded at its own position, so each
  maps to its own sample; nothing is overwritten.
* **Dropped turns** (an agent that leaves a failed turn out of the history and asks again): the dropped
  turn was sampled, so it is trained, as its own segment; the retry maps at the same position.
* **Edited history** (an assistant message changed, or the context before it): the message is rendered
  from its text and masked (``X-RL-History: edited``, counted in ``history_edits``); the original sample
  is trained as its own segment, under the context it was really sampled in.

The reward applies to every segment alike (one scalar per session). A session is per gateway process and
in memory (its turns are also on ``rl.served.v1``, keyed by session id): replicas behind a load balancer
need session affinity on the header. Sessions idle for ``ttl_s`` are forgotten, counted as expired.
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
from rlbus.schemas import Reward, Rollout, SamplingInfo, TensorData, Turn
from rlbus.serve.prompt import Rendered, SampledTurn


@dataclass
class Session:
    session_id: str
    tenant: str
    task: str
    """The rollout's prompt_id: the client's ``metadata.task``, else the session id."""
    created_at: float
    last_active: float
    turns: dict[int, list[SampledTurn]] = field(default_factory=dict)
    """Every sampled turn by its position in the conversation (`rlbus.serve.prompt.render` maps by it)."""
    sampled: list[tuple[SampledTurn, Rendered]] = field(default_factory=list)
    """Every sampled turn in order, with its sequence: the context it was sampled in, then the turn."""
    request_ids: list[str] = field(default_factory=list)
    sampling: SamplingInfo = field(default_factory=SamplingInfo)
    finish_reason: str = "stop"
    edits: int = 0
    closing: bool = False

    @property
    def sequence(self) -> Rendered | None:
        """The newest turn's sequence: its context plus the turn."""
        return self.sampled[-1][1] if self.sampled else None

    @property
    def oldest_version(self) -> int | None:
        """Oldest policy version among the tokens the session sampled."""
        versions = [min(t.versions) for t, _ in self.sampled if t.versions]
        return min(versions) if versions else None

    def segments(self) -> list[Rendered]:
        """The sequences that together hold every sampled turn once (module docstring), oldest first."""
        kept: list[Rendered] = []
        covered: set[int] = set()
        for turn, sequence in reversed(self.sampled):
            if id(turn) in covered:
                continue
            kept.append(sequence)
            covered |= {id(t) for t in sequence.mapped}
        return kept[::-1]

    def add_turn(self, context: Rendered, turn: SampledTurn, *, header_len: int, closing: list[int],
                 sampling: SamplingInfo, request_id: str, now: float) -> None:
        """Record the turn just sampled after ``context`` (which ends with the ``header_len`` ids of the
        generation prompt the turn opened with)."""
        sequence = context.copy()
        start = len(sequence.ids) - header_len
        sequence.add_sampled(turn.token_ids, turn.logprobs, turn.versions, turn.allowed)
        sequence.add(closing)
        sequence.mapped.append(turn)
        sequence.turn("assistant", turn.text, start)
        self.sampled.append((turn, sequence))
        self.turns.setdefault(turn.position, []).append(turn)
        self.sampling = sampling
        self.finish_reason = turn.finish_reason
        self.request_ids.append(request_id)
        self.last_active = now

    def rollout(self, *, model_id: str, worker_id: str, region: str, now: float) -> Rollout:
        """The session as one rollout (group of one), per the gateway's contract: its `segments` one after
        the other, each a context segment of its own."""
        parts = self.segments()
        if not parts or not any(any(p.mask) for p in parts):
            raise ApiError(409, f"session {self.session_id!r} has no sampled turn to train on",
                           param="session_id", code="session_empty")
        seq = _concatenate(parts)
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
            routed_experts=_segments_routing(parts),
            sampling=self.sampling,
            turns=list(seq.turns),
            finish_reason=self.finish_reason,
            timings={"session_s": now - self.created_at},
            created_at=now,
            metadata={
                "origin": "served", "tenant": self.tenant, "session_id": self.session_id,
                "request_ids": ",".join(self.request_ids), "history_edits": str(self.edits),
                "turns": str(len(self.sampled)), "segments": str(len(parts)),
            },
            allowed=seq.allowed_tokens(),
        )


def _concatenate(parts: list[Rendered]) -> Rendered:
    """Sequences one after the other, segment k's turns marked ``segment=k`` and covering all its ids."""
    out = Rendered()
    for k, part in enumerate(parts):
        offset = len(out.ids)
        for j, t in enumerate(part.turns):
            start = 0 if j == 0 else t.start  # the first turn opens the segment (BOS included)
            out.turns.append(Turn(role=t.role, text=t.text, start=offset + start, end=offset + t.end, segment=k))
        out.ids += part.ids
        out.mask += part.mask
        out.logprobs += part.logprobs
        out.versions += part.versions
        out.mapped += part.mapped
        out.allowed += [(offset + p, bits) for p, bits in part.allowed]
    return out


def _segments_routing(parts: list[Rendered]) -> TensorData | None:
    """Each segment's routing (`_routing`) concatenated along the tokens; None unless all have one."""
    pieces = [_routing(p.mapped, len(p.ids)) for p in parts]
    if any(p is None for p in pieces):
        return None
    arrays = [p.to_numpy() for p in pieces if p is not None]
    return TensorData.from_numpy(np.concatenate(arrays, axis=1))


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
