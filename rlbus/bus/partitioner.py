"""Kafka's default key partitioner (murmur2), so the in-memory bus places keys exactly like Kafka.

The algorithm is Austin Appleby's MurmurHash2 with Kafka's seed 0x9747b28c, as specified by the Java
client's ``Utils.murmur2``; keeping it identical means a replay from Kafka into the embedded bus (or the
reverse) keeps each group in the same partition number.
"""

from __future__ import annotations

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """32-bit murmur2 as a signed int, bit-compatible with Kafka's Java client."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    n4 = length // 4
    for i in range(n4):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    tail = data[4 * n4 :]
    if len(tail) >= 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if len(tail) >= 1:
        h ^= tail[0]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """Kafka's ``toPositive(murmur2(key)) % partitions``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
