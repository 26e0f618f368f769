"""Byte planes: a tensor's bytes split by position within each element, each plane compressed apart.

Keyframes (mode PLANES) split each float so its skewed exponent byte compresses on its own and the
near-uniform mantissa bytes are stored as they are (the ZipNN observation, Hershcovitch et al. 2024);
dense deltas (mode XOR) split old XOR new into one plane per byte. The exponent plane gets a zstd
preset for an order-0 source; the thread-local compressors serve the chunk container too.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import zstandard

from rlbus.errors import ChunkCorrupt
from rlbus.weights.bitview import NP_UINT
from rlbus.weights.codec._bits import Reader, put_bytes
from rlbus.weights.codec.format import _itemsize

_tls = threading.local()


def _zstd(level: int | None) -> zstandard.ZstdCompressor:
    """Thread-local compressors; ``None`` = the exponent-plane preset (literal-heavy, small window)."""
    cache = getattr(_tls, "zc", None)
    if cache is None:
        cache = _tls.zc = {}
    if level not in cache:
        if level is None:
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST, min_match=7, search_log=1, hash_log=12, window_log=17
            )
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _put_planes(out: bytearray, planes: list[np.ndarray], level: int | None) -> None:
    out.append(len(planes))
    for plane in planes:
        raw = plane.tobytes()
        packed = _zstd(level).compress(raw) if len(raw) >= 64 else raw
        if len(packed) < len(raw):
            out.append(1)
            put_bytes(out, packed)
        else:
            out.append(0)
            put_bytes(out, raw)


def _read_planes(r: Reader, count: int, n: int) -> list[np.ndarray]:
    if r.u8() != count:
        raise ChunkCorrupt("unexpected plane count")
    planes = []
    for _ in range(count):
        codec = r.u8()
        data = r.blob()
        if codec == 0:
            raw = bytes(data)
        elif codec == 1:
            try:
                raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=n)
            except zstandard.ZstdError as e:
                raise ChunkCorrupt(f"zstd: {e}") from None
        else:
            raise ChunkCorrupt(f"unknown plane codec {codec}")
        if len(raw) != n:
            raise ChunkCorrupt("plane has the wrong length")
        planes.append(np.frombuffer(raw, dtype=np.uint8))
    return planes


def _byte_planes(bits: np.ndarray) -> list[np.ndarray]:
    size = bits.dtype.itemsize
    b = bits.view(np.uint8).reshape(-1, size)
    return [np.ascontiguousarray(b[:, i]) for i in range(size)]


def _join_byte_planes(planes: list[np.ndarray], n: int) -> np.ndarray:
    size = len(planes)
    out = np.empty((n, size), dtype=np.uint8)
    for i, p in enumerate(planes):
        out[:, i] = p
    return out.reshape(-1).view(NP_UINT[size])


def _float_planes(bits: np.ndarray, dtype: torch.dtype) -> list[np.ndarray]:
    """ZipNN-style planes: the exponent byte on its own, sign and mantissa bytes beside it."""
    if dtype == torch.bfloat16:
        u = bits.astype(np.uint32)
        return [((u >> 7) & 0xFF).astype(np.uint8), (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)]
    if dtype == torch.float32:
        u = bits.astype(np.uint32)
        return [
            ((u >> 23) & 0xFF).astype(np.uint8),
            (((u >> 24) & 0x80) | ((u >> 16) & 0x7F)).astype(np.uint8),
            ((u >> 8) & 0xFF).astype(np.uint8),
            (u & 0xFF).astype(np.uint8),
        ]
    return _byte_planes(bits)[::-1]  # high byte first: fp16 sign|exponent|2 mantissa bits, then the rest


def _join_float_planes(planes: list[np.ndarray], dtype: torch.dtype, n: int) -> np.ndarray:
    if dtype == torch.bfloat16:
        e16, sm16 = (p.astype(np.uint16) for p in planes)
        return (((sm16 & 0x80) << 8) | (e16 << 7) | (sm16 & 0x7F)).astype(NP_UINT[2])
    if dtype == torch.float32:
        e, sm, mid, lo = (p.astype(np.uint32) for p in planes)
        return (((sm & 0x80) << 24) | (e << 23) | ((sm & 0x7F) << 16) | (mid << 8) | lo).astype(NP_UINT[4])
    return _join_byte_planes(planes[::-1], n)


def _plane_count(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 4 if dtype == torch.float32 else _itemsize(dtype)
