"""Blob stores for weight chunks: the contract, the local directory store and key rules.

Chunks are immutable once written (a key names model, version and chunk index), so every store can
cache freely and a reader verifies the manifest's hash rather than trusting the transport. The local
directory store is the embedded default; :mod:`rlbus.weights.http_store` serves any store over HTTP
(signed requests, range reads, a pull-through relay per region) and fetches from it in parallel, and
:func:`rlbus.weights.stores.open_store` opens either by URL. Key *rules* live here; where a weight
version's blobs go is :mod:`rlbus.weights.layout`.
"""

from __future__ import annotations

import abc
import asyncio
import os
import re
import tempfile
from pathlib import Path
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


class LocalStore(BlobStore):
    """Blobs as files under a root directory. Writes go to a temp file and are renamed into place, so
    a reader never sees a partial chunk. File I/O runs in a thread to keep the event loop free."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root):  # defence in depth: check_key already forbids '..'
            raise ValueError(f"invalid blob key {key!r}")
        return path

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, self._path(key), data)

    @staticmethod
    def _put(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except (FileNotFoundError, IsADirectoryError):
            raise BlobNotFound(f"blob {key!r} not found in {self.root}") from None

    async def get_range(self, key: str, start: int, stop: int) -> bytes:
        path = self._path(key)

        def read() -> bytes:
            with path.open("rb") as fh:
                fh.seek(start)
                return fh.read(max(0, stop - start))

        try:
            return await asyncio.to_thread(read)
        except (FileNotFoundError, IsADirectoryError):
            raise BlobNotFound(f"blob {key!r} not found in {self.root}") from None

    async def size(self, key: str) -> int:
        path = self._path(key)
        try:
            if not path.is_file():
                raise FileNotFoundError(path)
            return path.stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"blob {key!r} not found in {self.root}") from None

    async def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    async def list(self, prefix: str = "") -> list[str]:
        def walk() -> list[str]:
            keys = []
            for path in self.root.rglob("*"):
                if path.is_file() and not path.name.startswith(".tmp-"):
                    key = path.relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        keys.append(key)
            return sorted(keys)

        return await asyncio.to_thread(walk)
