"""The blob store contract and its key rules.

Blobs are immutable once written (a key names what it holds: a weight version's chunk, a claim-checked
message), so every store can cache freely and a reader verifies the hash it was given rather than
trusting the transport. :mod:`rlbus.blobs.local` is the directory store (the embedded default),
:mod:`rlbus.blobs.http` serves any store over HTTP and fetches from it, and :func:`rlbus.blobs.open.open_store`
opens either by URL. Where a weight version's blobs go is :mod:`rlbus.weights.layout`.
"""

from __future__ import annotations

import abc
import re
from types import TracebackType
from typing import Self

from rlbus.errors import BlobNotFound

_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


def check_key(key: str) -> str:
    """Keys are relative slash-separated names of [A-Za-z0-9._-]; no '..', no leading '/' or '.'."""
    if len(key) > 512 or not _KEY.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise ValueError(f"invalid blob key {key!r}")
    return key


class BlobStore(abc.ABC):
    """Immutable blobs by key."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        return None

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The whole blob; raises BlobNotFound."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the blob."""

    @abc.abstractmethod
    async def size(self, key: str) -> int: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove a blob; removing a missing blob is not an error (GC may race)."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]: ...

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
        except BlobNotFound:
            return False
        return True
