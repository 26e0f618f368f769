"""KV-cache surgery: select and merge keep rows right-aligned, for both cache types."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbus.engines import kv
from rlbus.models.policy import KVCache


def _slots(B: int, n: int, base: float) -> torch.Tensor:
    """[B, 1, n, 1] with value base + 10·row + slot, so every slot is identifiable."""
    return (base + 10 * torch.arange(B)[:, None] + torch.arange(n)[None, :]).float()[:, None, :, None]


def _policy_cache(B: int, n: int, base: float) -> KVCache:
    cache = KVCache(k=[torch.zeros(B, 1, n + 3, 1)], v=[torch.zeros(B, 1, n + 3, 1)], pos=n)
    cache.k[0][:, :, :n] = _slots(B, n, base)
    cache.v[0][:, :, :n] = -_slots(B, n, base)
    return cache


def _dynamic_cache(B: int, n: int, base: float) -> Any:
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()
    cache.update(_slots(B, n, base), -_slots(B, n, base), 0)
    return cache


def _keys(cache: Any) -> torch.Tensor:
    if isinstance(cache, KVCache):
        return cache.k[0][:, :, : cache.pos]
    return cache.layers[0].keys


@pytest.mark.parametrize("make", [_policy_cache, _dynamic_cache])
def test_merge_left_pads_the_shorter_side_to_one_offset(make: Any) -> None:
    a, b = make(2, 3, 0.0), make(1, 5, 100.0)
    merged = kv.merge(a, b, capacity=9)
    assert kv.length(merged) == 5
    keys = _keys(merged)[:, 0, :, 0]  # [3, 5]
    assert keys.tolist() == [[0, 0, 0, 1, 2], [0, 0, 10, 11, 12], [100, 101, 102, 103, 104]]
    if isinstance(merged, KVCache):
        assert merged.max_len == 9


@pytest.mark.parametrize("make", [_policy_cache, _dynamic_cache])
def test_select_keeps_rows_and_drops_leading_slots(make: Any) -> None:
    cache = make(3, 4, 0.0)
    kept = kv.select(cache, torch.tensor([2, 0]), 1, capacity=6)
    assert kv.length(kept) == 3
    assert _keys(kept)[:, 0, :, 0].tolist() == [[21, 22, 23], [1, 2, 3]]


def test_no_cache_stays_none_and_unknown_caches_are_refused() -> None:
    assert kv.merge(None, None, capacity=4) is None and kv.select(None, torch.tensor([0]), 0, capacity=1) is None
    assert kv.length(None) == 0
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match="no KV-cache surgery"):
        kv.length(object())
