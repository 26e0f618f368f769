"""KV-cache surgery for continuous batching: keep some rows, drop leading slots, merge two batches.

`rlbus.engines.torch_engine` keeps one left-padded batch in flight and changes its membership between
decode steps. Every row is right-aligned: its real slots are the last ones, and all rows share one slot
count S (the cache offset). The three operations below preserve that layout:

* `length(cache)` — S, the slots filled so far.
* `select(cache, rows, start)` — keep ``rows`` (in that order) and slots [start, S); the engine drops
  finished rows and, with them, leading slots that no remaining row uses (compaction).
* `merge(a, b)` — the rows of ``a`` then the rows of ``b``; the shorter side is left padded with zero
  slots so both end at the same offset max(S_a, S_b). The engine masks those slots in its key mask.
* `row_slots(cache, row, slots)` / `restore(empty, kept, n)` — copy one row's real slots out of a batch
  (the engine's prefix cache keeps a finished row's keys/values) and start a one-row cache from the first
  ``n`` of them.

``capacity`` is the slot count a preallocated cache must hold afterwards (filled slots + decode steps to
come); caches that grow on demand ignore it. Dispatch is on the cache type, so the model files stay
untouched: ``None`` (a model without a cache), the in-house `rlbus.models.policy.KVCache` (preallocated,
slot offset ``pos``) and a transformers ``DynamicCache`` of plain full-attention layers (grown by
concatenation; sliding-window or quantised layers cannot be re-aligned this way and are refused).
"""

from __future__ import annotations

from typing import Any

import torch

from rlbus.models.policy import KVCache


def length(cache: Any) -> int:
    """Filled slots S (0 for no cache)."""
    if cache is None:
        return 0
    if isinstance(cache, KVCache):
        return cache.pos
    layers = _dynamic_layers(cache)
    return 0 if not layers or layers[0].keys is None else int(layers[0].keys.shape[-2])


def select(cache: Any, rows: torch.Tensor, start: int, *, capacity: int) -> Any:
    """Keep ``rows`` [B'] (long) and slots [start, S): the result holds S - start slots."""
    if cache is None:
        return None
    if isinstance(cache, KVCache):
        filled = cache.pos - start
        k = [_place(layer[rows, :, start : cache.pos], capacity, filled) for layer in cache.k]
        v = [_place(layer[rows, :, start : cache.pos], capacity, filled) for layer in cache.v]
        return KVCache(k=k, v=v, pos=filled)
    for layer in _dynamic_layers(cache):
        if layer.keys is None:
            continue
        layer.keys = layer.keys[rows, :, start:]  # [B', H, S - start, D]
        layer.values = layer.values[rows, :, start:]  # [B', H, S - start, D]
    return cache


def merge(a: Any, b: Any, *, capacity: int) -> Any:
    """Rows of ``a`` then rows of ``b``, left padded to a shared offset max(S_a, S_b)."""
    if a is None or b is None:
        if a is not None or b is not None:
            raise TypeError("cannot merge a cache with no cache")
        return None
    S = max(length(a), length(b))
    if isinstance(a, KVCache) and isinstance(b, KVCache):
        k = [torch.cat([_place(x[:, :, : a.pos], capacity, S), _place(y[:, :, : b.pos], capacity, S)])
             for x, y in zip(a.k, b.k, strict=True)]
        v = [torch.cat([_place(x[:, :, : a.pos], capacity, S), _place(y[:, :, : b.pos], capacity, S)])
             for x, y in zip(a.v, b.v, strict=True)]
        return KVCache(k=k, v=v, pos=S)
    if isinstance(a, KVCache) or isinstance(b, KVCache):
        raise TypeError(f"cannot merge {type(a).__name__} with {type(b).__name__}")
    for x, y in zip(_dynamic_layers(a), _dynamic_layers(b), strict=True):
        x.keys = torch.cat([_left_pad(x.keys, S), _left_pad(y.keys, S)])  # [B_a + B_b, H, S, D]
        x.values = torch.cat([_left_pad(x.values, S), _left_pad(y.values, S)])  # [B_a + B_b, H, S, D]
    return a


def row_slots(cache: Any, row: int, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s keys/values at ``slots`` ([S] bool, the row's key mask): per layer ([1, H, n, D] × 2),
    copies that outlive the batch's cache."""
    if isinstance(cache, KVCache):
        return [(k[row : row + 1, :, : cache.pos][:, :, slots], v[row : row + 1, :, : cache.pos][:, :, slots])
                for k, v in zip(cache.k, cache.v, strict=True)]  # fmt: skip
    return [(layer.keys[row : row + 1, :, slots], layer.values[row : row + 1, :, slots])
            for layer in _dynamic_layers(cache)]  # fmt: skip


def restore(empty: Any, kept: list[tuple[torch.Tensor, torch.Tensor]], n: int, *, capacity: int) -> Any:
    """The one-row cache ``empty`` (fresh from the model's ``new_cache``) holding the first ``n`` slots of
    ``kept`` (from `row_slots`)."""
    if isinstance(empty, KVCache):
        k = [_place(key[:, :, :n], capacity, n) for key, _ in kept]
        v = [_place(value[:, :, :n], capacity, n) for _, value in kept]
        return KVCache(k=k, v=v, pos=n)
    _dynamic_layers(empty)  # refuses caches whose layers cannot be restored this way
    for i, (key, value) in enumerate(kept):
        empty.update(key[:, :, :n], value[:, :, :n], i)
    return empty


def _place(slots: torch.Tensor, capacity: int, end: int) -> torch.Tensor:
    """A zero [B, H, capacity, D] tensor with ``slots`` [B, H, n, D] written to end at slot ``end``."""
    B, H, n, D = slots.shape
    out = slots.new_zeros(B, H, max(capacity, end), D)
    out[:, :, end - n : end] = slots
    return out


def _left_pad(slots: torch.Tensor, S: int) -> torch.Tensor:
    """[B, H, n, D] → [B, H, S, D] with S - n zero slots in front."""
    B, H, n, D = slots.shape
    if n == S:
        return slots
    return torch.cat([slots.new_zeros(B, H, S - n, D), slots], dim=2)


def _dynamic_layers(cache: Any) -> list[Any]:
    """The layers of a transformers ``DynamicCache``, each checked to be a plain full-attention layer."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache):
        raise TypeError(f"no KV-cache surgery for {type(cache).__name__}")
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"no KV-cache surgery for {type(layer).__name__} (only full-attention DynamicLayer)")
    return list(cache.layers)
