"""The torch engine's prefix cache: a finished row's keys/values, reused by the next prompt that extends it.

A multi-turn episode asks for one completion per turn, and turn t + 1's prompt is turn t's prompt, its
completion, the observation and the next header: everything but the last two was already computed when
turn t was sampled. Without reuse the engine re-prefills the whole context every turn, O(turns²) tokens
per episode: 16 coding episodes of SmolLM2 at 1–2 K tokens spent most of their time there. vLLM does the
same reuse with hashed blocks ("automatic prefix caching"); this one keeps whole rows, which is what
agent turns need and needs no block allocator.

Entries. When a row finishes, the engine hands its fed tokens (prompt + every sampled token but the last,
which was never fed) and their keys/values (`rlbus.engines.kv.row_slots`) to `PrefixCache.add`. An entry
that is a prefix of the new one is dropped (the new one covers it). Least recently used entries are evicted
once the cache holds more than ``max_tokens`` tokens.

Lookup. `PrefixCache.match` finds the entry with the longest common prefix with a new prompt; the engine
starts the row from the first ``n = min(common, len(prompt) - 1)`` cached slots (at least one prompt token
is fed, for the logits) and prefills only the rest. Matches shorter than ``min_tokens`` are ignored: a
tiny shared prefix (BOS, a system header) is not worth a separate forward.

Weights. Every entry records the policy version its keys/values were computed under; a match requires the
engine's current version, so after a weight swap nothing computed by old weights is reused (the same rule
as vLLM, which resets its prefix cache on a weight update). Stale entries are dropped when next seen.

Numerics. A reused slot holds the keys/values the row computed in its own batch; recomputing them in
another batch differs only by float rounding, the same freedom continuous batching already takes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Prefix:
    """Keys/values of ``ids`` under ``version`` (per layer [1, H, n, D]), and their routed experts if MoE."""

    ids: np.ndarray[Any, Any]  # [n] int64
    slots: list[tuple[torch.Tensor, torch.Tensor]]
    version: int
    experts: torch.Tensor | None = None  # [L, n, k]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class PrefixStats:
    """Counters since the engine started (what an operator checks to see the cache is earning its memory)."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    evicted: int = 0
    stale: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class PrefixCache:
    """Finished rows' keys/values by token ids, least recently used evicted beyond ``max_tokens``."""

    max_tokens: int
    min_tokens: int = 32
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: OrderedDict[int, Prefix] = field(default_factory=OrderedDict)
    _tokens: int = 0
    _next: int = 0

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: np.ndarray[Any, Any], version: int) -> tuple[Prefix, int] | None:
        """The entry sharing the longest prefix with ``prompt`` under ``version`` and how many of its slots
        to reuse (at most len(prompt) - 1), or None; counts the lookup."""
        self.stats.lookups += 1
        best: tuple[int, int] | None = None  # (reusable, key)
        for key, entry in list(self._entries.items()):
            if entry.version != version:
                self._drop(key)
                self.stats.stale += 1
                continue
            reusable = min(_common(entry.ids, prompt), len(prompt) - 1)
            if reusable >= self.min_tokens and (best is None or reusable > best[0]):
                best = (reusable, key)
        if best is None:
            return None
        reusable, key = best
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.reused_tokens += reusable
        return self._entries[key], reusable

    def add(self, entry: Prefix) -> None:
        """Keep ``entry``; drop what it covers and the least recently used beyond the budget."""
        if len(entry) < self.min_tokens or len(entry) > self.max_tokens:
            return
        for key, old in list(self._entries.items()):
            if len(old) <= len(entry) and _common(old.ids, entry.ids) == len(old):
                self._drop(key)
        self._entries[self._next] = entry
        self._next += 1
        self._tokens += len(entry)
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def _drop(self, key: int) -> None:
        self._tokens -= len(self._entries.pop(key))


def _common(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
