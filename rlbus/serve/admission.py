"""Admission control for RL sessions: refuse (429 + Retry-After) work the trainer would drop as stale.

The trainer drops a rollout whose oldest token is more than ``max_staleness`` versions behind it
(`rlbus.rl.staleness`). Served traffic that is meant for training — an agent session, or a completion
the client asked to record as a rollout — is therefore refused while it could only produce such data,
instead of being generated and thrown away (the prompt producer's admission control, for traffic the
gateway does not schedule itself):

* ``engine_behind``: the engine serves version s while the trainer has announced T > s + max_staleness
  (weight sync is behind: its blob store down, a delta still staging). Retry after ``retry_after_s``;
  sync catches up meanwhile.
* ``session_stale``: the session's oldest sampled token is at o < T − max_staleness: its rollout is
  already too old to train, however it continues. Close it and start a new session.
* ``too_many_sessions``: opening one more session would exceed ``max_open`` RL sessions.

Production requests (no session, not recorded as a rollout) are never refused for any of these: they
are served on whatever version the engine holds, and recorded on ``rl.served.v1`` all the same.
"""

from __future__ import annotations

from collections.abc import Callable

from rlbus.errors import ApiError
from rlbus.metrics import SERVE_REJECTED


class Admission:
    def __init__(
        self,
        *,
        max_staleness: int | None,
        trainer_version: Callable[[], int | None],
        max_open: int = 1000,
        retry_after_s: float = 5.0,
    ) -> None:
        """``max_staleness`` None: no staleness bound; ``trainer_version`` the newest version the trainer
        announced (None: not known yet)."""
        self.max_staleness = max_staleness
        self.trainer_version = trainer_version
        self.max_open = max_open
        self.retry_after_s = retry_after_s
        self.refused: dict[str, int] = {}

    def check(self, *, served_version: int, oldest: int | None, opening: bool, open_sessions: int) -> None:
        """Raise a 429 ApiError when this RL request should wait (see the module docstring)."""
        if opening and open_sessions >= self.max_open:
            self._refuse("too_many_sessions", f"{open_sessions} RL sessions are open (at most {self.max_open})")
        trainer = self.trainer_version()
        if self.max_staleness is None or trainer is None:
            return
        if trainer - served_version > self.max_staleness:
            self._refuse("engine_behind", f"this gateway serves policy v{served_version} but the trainer is at "
                         f"v{trainer} (max_staleness {self.max_staleness}): new tokens would be dropped as stale")
        if oldest is not None and trainer - oldest > self.max_staleness:
            self._refuse("session_stale", f"the session's oldest tokens are from v{oldest}, more than "
                         f"max_staleness {self.max_staleness} behind the trainer's v{trainer}: close it "
                         "(POST /rl/sessions/{id}/reward) and start a new session")

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        SERVE_REJECTED.labels(reason).inc()
        raise ApiError(429, message, type="rate_limit_error", code=reason, retry_after_s=self.retry_after_s)
