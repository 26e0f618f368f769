"""Shared state of the RL loop: the state store (Redis, or in memory) that holds the trainer's join buffer and
exactly-once ledger (their logic is the trainer's: :mod:`rlbus.training.join`), the counters the trainer, the
prompt producer and the observers share (``progress`` names them), and the worker registry.

``open_state_store`` turns a URL from configuration into a store: ``memory://`` for the embedded
demo, ``redis://host:port/db`` (or ``rediss://``, ``unix://``) for real runs.
"""

from __future__ import annotations

from rlbus.errors import ConfigError
from rlbus.state.base import StateStore, WorkerRecord
from rlbus.state.memory import MemoryStateStore
from rlbus.state.redis import DEFAULT_PREFIX, RedisStateStore

__all__ = ["MemoryStateStore", "RedisStateStore", "StateStore", "WorkerRecord", "open_state_store"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_state_store(url: str, *, key_prefix: str = DEFAULT_PREFIX) -> StateStore:
    """The store ``url`` names; ``key_prefix`` separates runs sharing one Redis. A Redis store rides
    out a server restart (reconnecting for about half a minute) rather than failing its worker."""
    if url == "memory://":
        return MemoryStateStore()
    if url.startswith(_REDIS_SCHEMES):
        return RedisStateStore.from_url(url, key_prefix=key_prefix, reconnect=True)
    raise ConfigError("state_url", f"expected memory:// or redis://host:port/db, got {url!r}")
