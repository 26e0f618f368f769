"""Opening a blob store by URL: the one function that knows every store kind.

It sits above :mod:`rlbus.blobs.local` (the directory store) and :mod:`rlbus.blobs.http` (the HTTP
client), both implementations of :class:`rlbus.blobs.base.BlobStore`, so neither has to import the other.
"""

from __future__ import annotations

from rlbus.blobs.base import BlobStore
from rlbus.blobs.http import HttpStore
from rlbus.blobs.local import LocalStore
from rlbus.errors import ConfigError


def open_store(url: str, *, secret: str | None = None) -> BlobStore:
    """``/path`` or ``file:///path`` → LocalStore; ``http(s)://host:port`` → HttpStore client.

    ``secret`` is the server's master secret or a scoped key minted from it (``rbk1.…``,
    :mod:`rlbus.blobs.keys`): a worker given a read-only key opens its store exactly as the trainer does."""
    if url.startswith(("http://", "https://")):
        if not secret:
            raise ConfigError("blobs.secret", "an HTTP blob store needs the signing secret or a scoped key "
                              "(RLBUS_BLOB_SECRET)")
        return HttpStore(url, secret=secret)
    return LocalStore(url.removeprefix("file://"))
