"""Bit-exact views of tensors: weight sync compares, codes and swaps bit patterns, never float values.

A float compared as a float loses NaN payloads and equates -0.0 with +0.0; viewed as the integer of the
same width it keeps every bit. The codec reads these views, the swap scatters through them and the
digest hashes them, so a worker's weights end up bit-identical to the trainer's cast snapshot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: The integer dtype of each element width, for in-place views of a tensor's bits.
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: The little-endian unsigned numpy dtype of each element width.
NP_UINT: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


def int_flat(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of a tensor's bit patterns (same device, no copy when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(INT_VIEW[t.element_size()])


def np_bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned numpy view of a CPU tensor's bit patterns (copies from an accelerator)."""
    flat = int_flat(t)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.numpy().view(NP_UINT[t.element_size()])


def tensor_from_bits(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` holding the bit patterns ``bits``."""
    size = torch.empty(0, dtype=dtype).element_size()
    arr = np.ascontiguousarray(bits).view(NP_UINT[size])
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[size]
    return torch.from_numpy(arr.view(signed).copy()).view(dtype)
