"""Advantages for served traffic: single samples with late user rewards, no group to compare against.

GRPO's baseline is the mean reward of G samples of one prompt (`rlbus.rl.advantages`). A served
completion is one sample x ~ μ for one user; its reward r (a thumb, [0, 1]) arrives minutes or hours
later. The baseline then has to come from *other* samples — of the same task key, of the same tenant, or
of all traffic — so the policy gradient E[(r − b) ∇log π(x)] stays unbiased (b must not depend on x's own
r) while its variance drops. Two estimators, per baseline key k:

    ema   REINFORCE with a running baseline (Williams 1992; Sutton & Barto §13.4):
              A_i = r_i − b_k          then   b_k ← (1 − α) · b_k + α · r_i
          samples of one batch are taken in order, so each sees the baseline before its own reward.
    loo   leave-one-out over a sliding window (RLOO, Ahmadian et al. 2024 "Back to Basics", applied to a
          window of recent samples of the key instead of k samples of one prompt):
              A_i = r_i − mean(W_k ∪ B_k ∖ {i})
          W_k = the last ``window`` rewards of k before this batch, B_k = this batch's rewards of k;
          afterwards W_k keeps the last ``window`` of W_k ++ B_k.

Sparse keys. A key seen fewer than ``min_count`` times has no baseline of its own worth the name (one
thumbs-down would make every later sample look good), so it uses the global baseline — the same estimator
over every key's rewards — and a run that has seen nothing at all uses ``init`` (0.5: neutral on the
thumbs scale). The baseline is a scalar per key, so this module is plain Python floats: the trainer turns
the advantages into the [R] tensor the step takes, and the run config (which never imports torch) can
name the estimator.

What it cannot fix: the baseline removes the reward level of a key, not the difference between prompts
of one key (a hard question rated down looks like a bad answer), and a thumb is one scalar per whole
session (no credit assignment to turns). docs/online.md lists the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Estimator = Literal["ema", "loo"]

#: The key of the global baseline (every sample also updates it).
GLOBAL = ""


def ema_advantages(rewards: Sequence[float], baseline: float, alpha: float) -> tuple[list[float], float]:
    """(A_i = r_i − b before r_i, the baseline after the last update) for one key's rewards in order."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    advantages = []
    b = baseline
    for r in rewards:
        advantages.append(r - b)
        b = (1 - alpha) * b + alpha * r
    return advantages, b


def loo_advantages(window: Sequence[float], rewards: Sequence[float], *, init: float) -> list[float]:
    """A_i = r_i − mean of every other reward in ``window`` ∪ ``rewards``; ``init`` when there is no other."""
    total = sum(window) + sum(rewards)
    others = len(window) + len(rewards) - 1
    return [r - ((total - r) / others if others > 0 else init) for r in rewards]


@dataclass
class KeyStats:
    """One baseline key's running state."""

    count: int = 0
    """Rewards this key has seen."""
    mean: float | None = None
    """The EMA (None before the first reward)."""
    window: deque[float] = field(default_factory=deque)
    """The last ``window`` rewards (the LOO estimator's)."""


class OnlineBaseline:
    """Running baselines per key and globally; `advantages` computes a batch's and then folds it in."""

    def __init__(
        self, *, estimator: Estimator = "ema", alpha: float = 0.1, window: int = 64, min_count: int = 8,
        init: float = 0.5,
    ) -> None:
        if estimator not in ("ema", "loo"):
            raise ValueError(f"estimator must be 'ema' or 'loo', got {estimator!r}")
        if not 0 < alpha <= 1 or window < 1 or min_count < 0:
            raise ValueError("need 0 < alpha <= 1, window >= 1, min_count >= 0")
        self.estimator: Estimator = estimator
        self.alpha, self.window, self.min_count, self.init = alpha, window, min_count, init
        self.keys: dict[str, KeyStats] = {}

    def _stats(self, key: str) -> KeyStats:
        return self.keys.setdefault(key, KeyStats(window=deque(maxlen=self.window)))

    def _owner(self, key: str) -> str:
        """The key whose baseline ``key`` uses now: its own once it has ``min_count`` rewards, else global."""
        stats = self.keys.get(key)
        return key if stats is not None and stats.count >= max(self.min_count, 1) else GLOBAL

    def value(self, key: str = GLOBAL) -> float:
        """The baseline a new sample of ``key`` would get (EMA or window mean; ``init`` before any reward)."""
        stats = self.keys.get(self._owner(key))
        if stats is None or stats.count == 0:
            return self.init
        if self.estimator == "ema":
            return self.init if stats.mean is None else stats.mean
        return sum(stats.window) / len(stats.window)

    def advantages(self, keys: Sequence[str], rewards: Sequence[float]) -> list[float]:
        """A_i for each (key, reward) of one batch (see the module docstring), then every reward updates
        its key's and the global state. Which baseline a key uses is decided before the batch."""
        if len(keys) != len(rewards):
            raise ValueError(f"{len(keys)} keys but {len(rewards)} rewards")
        owners = [self._owner(k) for k in keys]
        out = [0.0] * len(rewards)
        for owner in dict.fromkeys(owners):
            idx = [i for i, o in enumerate(owners) if o == owner]
            batch = [float(rewards[i]) for i in idx]
            stats = self._stats(owner)
            if self.estimator == "ema":
                adv, _ = ema_advantages(batch, self.init if stats.mean is None else stats.mean, self.alpha)
            else:
                adv = loo_advantages(stats.window, batch, init=self.init)
            for i, a in zip(idx, adv, strict=True):
                out[i] = a
        for key, r in zip(keys, rewards, strict=True):
            for name in dict.fromkeys((key, GLOBAL)):
                self._fold(self._stats(name), float(r))
        return out

    def _fold(self, stats: KeyStats, r: float) -> None:
        stats.count += 1
        stats.mean = (1 - self.alpha) * (self.init if stats.mean is None else stats.mean) + self.alpha * r
        stats.window.append(r)

    # --- persistence: the trainer keeps it in the state store, so a restart keeps its baselines -------------
    def state(self) -> dict[str, Any]:
        """JSON-ready state (`restore` is the inverse)."""
        return {k: {"count": s.count, "mean": s.mean, "window": list(s.window)} for k, s in self.keys.items()}

    def restore(self, state: dict[str, Any]) -> None:
        self.keys = {
            k: KeyStats(count=int(v["count"]), mean=v["mean"], window=deque(v["window"], maxlen=self.window))
            for k, v in state.items()
        }

    def summary(self, keys: Iterable[str] = ()) -> dict[str, float]:
        """The global baseline and the baselines of ``keys`` (the step's metric)."""
        return {"global": self.value(GLOBAL), **{k: self.value(k) for k in keys}}
