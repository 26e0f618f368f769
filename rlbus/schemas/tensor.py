"""Tensors on the wire as (dtype, shape, bytes).

A tensor is carried as its dtype name, its shape and its raw little-endian bytes, so any language with a
MessagePack reader can rebuild it. bfloat16 has no numpy dtype: its bytes are the upper halves of fp32
values and readers without bf16 support can widen them with a 16-bit shift. torch is imported lazily so
the producers and the reward worker never pull it in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

#: dtype name → (element size in bytes, numpy dtype used to view the bytes)
DTYPES: dict[str, tuple[int, str]] = {
    "bool": (1, "|b1"),
    "uint8": (1, "|u1"),
    "int8": (1, "|i1"),
    "int16": (2, "<i2"),
    "int32": (4, "<i4"),
    "int64": (8, "<i8"),
    "float16": (2, "<f2"),
    "bfloat16": (2, "<u2"),
    "float32": (4, "<f4"),
    "float64": (8, "<f8"),
}


class TensorData(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A dense tensor: ``dtype`` is one of :data:`DTYPES`, ``data`` is C-order little-endian bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        expected = DTYPES[self.dtype][0] * math.prod(self.shape)
        if len(self.data) != expected:
            raise ValueError(
                f"tensor bytes {len(self.data)} do not match dtype {self.dtype} and shape {self.shape}"
                f" ({expected} expected)"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_numpy(cls, array: np.ndarray[Any, Any], dtype: str | None = None) -> TensorData:
        """Wrap a numpy array; pass ``dtype="bfloat16"`` for a uint16 array holding bf16 bits."""
        name = dtype or str(array.dtype)
        if name not in DTYPES:
            raise ValueError(f"unsupported numpy dtype {array.dtype}")
        contiguous = np.ascontiguousarray(array, dtype=np.dtype(DTYPES[name][1]))
        return cls(dtype=name, shape=list(array.shape), data=contiguous.tobytes())

    def to_numpy(self) -> np.ndarray[Any, Any]:
        """A read-only numpy view; bfloat16 comes back as its uint16 bit patterns."""
        return np.frombuffer(self.data, dtype=np.dtype(DTYPES[self.dtype][1])).reshape(self.shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name == "bfloat16":
            return cls(dtype=name, shape=list(t.shape), data=t.view(torch.int16).numpy().tobytes())
        return cls.from_numpy(t.numpy(), name)

    def to_torch(self) -> torch.Tensor:
        import torch

        if self.dtype == "bfloat16":
            raw = np.frombuffer(self.data, dtype="<i2").copy()
            return torch.from_numpy(raw).view(torch.bfloat16).reshape(self.shape)
        return torch.from_numpy(self.to_numpy().copy())
