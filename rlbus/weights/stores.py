"""Opening a blob store by URL: the one function that knows every store kind.

It sits above both :mod:`rlbus.weights.store` (the contract and the local directory store) and
:mod:`rlbus.weights.http_store` (the HTTP client, a subclass of that contract), so neither of them has
to import the other's module back.
"""

from __future__ import annotations

from rlbus.errors import ConfigError
from rlbus.weights.http_store import HttpStore
from rlbus.weights.store import BlobStore, LocalStore


def open_store(url: str, *, secret: str | None = None) -> BlobStore:
    """``/path`` or ``file:///path`` → LocalStore; ``http(s)://host:port`` → HttpStore client."""
    if url.startswith(("http://", "https://")):
        if not secret:
            raise ConfigError("blobs.secret", "an HTTP blob store needs the shared signing secret (RLBUS_BLOB_SECRET)")
        return HttpStore(url, secret=secret)
    return LocalStore(url.removeprefix("file://"))
