"""The staged form of a weight change and its in-place swap into model state.

Decoding a version (:mod:`rlbus.weights.codec`) ends in :class:`SparseUpdate`\\ s — positions and new
values, or a dense replacement — held while generation continues; :func:`apply_update_` is the swap, one
scatter on the tensor's integer view, so it is bit-exact on any device and cheap enough to run between
two decode steps (on the CPU a compiled loop, :mod:`rlbus.weights._scatter`). Nothing here knows the byte
format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlbus.errors import WeightSyncError
from rlbus.weights._scatter import scatter
from rlbus.weights.bitview import INT_VIEW


@dataclass(frozen=True)
class SparseUpdate:
    """A decoded change to one tensor, ready to swap in with :func:`apply_update_`.

    ``positions`` (int64 flat indices) and ``values`` (new elements, in the tensor's dtype) are scattered;
    ``dense``, when set, replaces elements [dense_start, dense_start + len(dense)).
    """

    numel: int
    dtype: torch.dtype
    positions: torch.Tensor
    values: torch.Tensor
    dense: torch.Tensor | None = None
    dense_start: int = 0

    @property
    def changed(self) -> int:
        return len(self.positions) + (0 if self.dense is None else len(self.dense))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseUpdate:
        """The same update with its tensors on ``device`` (stage on the GPU before the swap)."""
        dense = None if self.dense is None else self.dense.to(device, non_blocking=non_blocking)
        return SparseUpdate(
            self.numel,
            self.dtype,
            self.positions.to(device, non_blocking=non_blocking),
            self.values.to(device, non_blocking=non_blocking),
            dense,
            self.dense_start,
        )


def apply_update_(t: torch.Tensor, update: SparseUpdate) -> None:
    """Swap a staged update into ``t`` in place: a scatter on the integer view (bit-exact, any device)."""
    if t.dtype != update.dtype or t.numel() != update.numel:
        raise WeightSyncError(f"update for {update.dtype}[{update.numel}] applied to {t.dtype}[{t.numel()}]")
    if not t.is_contiguous():
        raise ValueError("apply_update_ needs a contiguous tensor")
    flat = t.view(-1).view(INT_VIEW[t.element_size()])
    ivt = INT_VIEW[t.element_size()]
    if update.dense is not None:
        s = update.dense_start
        flat[s : s + len(update.dense)].copy_(update.dense.view(ivt), non_blocking=True)
    if not len(update.positions):
        return
    if t.device.type == "cpu" and update.positions.device.type == "cpu" and update.values.device.type == "cpu":
        if not scatter(flat.detach().numpy(), update.positions.numpy(), update.values.view(ivt).numpy()):
            raise WeightSyncError(f"update positions out of range for {t.dtype}[{t.numel()}]")
        return
    idx = update.positions.to(t.device, non_blocking=True)
    flat.index_put_((idx,), update.values.view(ivt).to(t.device, non_blocking=True))
