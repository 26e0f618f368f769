"""The local directory store: blobs as files under a root directory, the embedded default.

Writes go to a temporary file renamed into place, so a reader never sees a partial blob; file I/O runs in
a thread so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from rlbus.blobs.base import BlobStore, check_key
from rlbus.errors import BlobNotFound


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
