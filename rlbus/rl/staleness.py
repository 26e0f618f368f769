"""Staleness: how many weight versions behind the trainer a rollout is, and which rollouts to drop.

Every token carries the policy version that produced it (a rollout can span a weight swap). A rollout's
staleness is measured from its *oldest* token, because that bounds how off-policy any of its tokens is:

    staleness = current_version − min_t v_t
    keep      ⇔ staleness ≤ max_staleness

``max_staleness = 0`` is fully on-policy (only rollouts generated entirely by the current version).
A rollout whose oldest version is newer than the trainer's is an error (the trainer cannot have trained
a version it has not reached: a restart from an older checkpoint, or a foreign model), reported as
``ValueError`` so the caller can dead-letter it with the reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def oldest_version(token_versions: Sequence[int]) -> int:
    """min_t v_t of one rollout's per-token versions."""
    if len(token_versions) == 0:
        raise ValueError("a rollout without tokens has no version")
    return min(token_versions)


def staleness(current_version: int, oldest_versions: torch.Tensor) -> torch.Tensor:
    """current − oldest [R] (int64) for the per-rollout oldest versions [R]."""
    s = current_version - oldest_versions.long()  # [R]
    if bool((s < 0).any()):
        newest = int(oldest_versions.max())
        raise ValueError(f"rollout version {newest} is newer than the trainer's version {current_version}")
    return s


def fresh_mask(current_version: int, oldest_versions: torch.Tensor, *, max_staleness: int) -> torch.Tensor:
    """[R] bool: True for rollouts at most ``max_staleness`` versions behind."""
    if max_staleness < 0:
        raise ValueError("max_staleness must be >= 0")
    return staleness(current_version, oldest_versions) <= max_staleness


def split_fresh(
    items: Sequence[T], oldest_versions: Sequence[int], current_version: int, *, max_staleness: int
) -> tuple[list[T], list[T]]:
    """(fresh, stale) partition of ``items``, order kept; ``oldest_versions[i]`` belongs to ``items[i]``."""
    if len(items) != len(oldest_versions):
        raise ValueError(f"{len(items)} items but {len(oldest_versions)} versions")
    keep = fresh_mask(
        current_version, torch.tensor(list(oldest_versions), dtype=torch.long), max_staleness=max_staleness
    ).tolist()
    fresh = [x for x, k in zip(items, keep, strict=True) if k]
    stale = [x for x, k in zip(items, keep, strict=True) if not k]
    return fresh, stale


def staleness_histogram(current_version: int, oldest_versions: torch.Tensor) -> dict[int, int]:
    """{staleness: rollout count}, sorted by staleness — the per-batch staleness report (docs/architecture.md §5)."""
    counts = Counter(staleness(current_version, oldest_versions).tolist())
    return dict(sorted(counts.items()))
