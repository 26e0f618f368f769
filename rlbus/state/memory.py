"""In-process StateStore for the embedded demo and unit tests.

Same behaviour as the Redis store, with expiry checked lazily against an injectable monotonic
clock. State lives in one event loop's process and dies with it, which is all a single-process
demo needs. Worker info goes through JSON, as in Redis, so both stores return the same values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from rlbus.state.base import (
    Merged,
    StateStore,
    WorkerRecord,
    by_role,
    check_ttl,
    decode_worker,
    encode_worker,
)

SWEEP_INTERVAL_S = 1.0


class MemoryStateStore(StateStore):
    """A StateStore held in dictionaries; ``clock`` returns seconds (default ``time.monotonic``)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._marks: dict[tuple[str, str], float | None] = {}
        self._buffers: dict[str, tuple[dict[str, bytes], float | None]] = {}
        self._counters: dict[str, int] = {}
        self._workers: dict[tuple[str, str], tuple[str, float]] = {}
        self._next_sweep = clock() + SWEEP_INTERVAL_S

    def _deadline(self, ttl_s: float | None) -> float | None:
        check_ttl(ttl_s)
        self._sweep()
        return None if ttl_s is None else self._clock() + ttl_s

    def _sweep(self) -> None:
        """Drop expired entries, at most once a second, so unread ones do not pile up."""
        if self._clock() < self._next_sweep:
            return
        self._next_sweep = self._clock() + SWEEP_INTERVAL_S
        self._marks = {k: d for k, d in self._marks.items() if self._live(d)}
        self._buffers = {k: v for k, v in self._buffers.items() if self._live(v[1])}
        self._workers = {k: v for k, v in self._workers.items() if self._live(v[1])}

    def _live(self, deadline: float | None) -> bool:
        return deadline is None or self._clock() < deadline

    async def mark_once(self, namespace: str, id: str, ttl_s: float | None = None) -> bool:
        deadline = self._deadline(ttl_s)
        if await self.seen(namespace, id):
            return False
        self._marks[namespace, id] = deadline
        return True

    async def mark_once_counted(
        self, namespace: str, ids: Sequence[str], *, counter: str, also: Sequence[str] = (),
        repeats: Sequence[str] = (),
    ) -> list[bool]:
        """No ``await`` between the marks and the counts: atomic within the event loop."""
        self._sweep()
        new = []
        for id in ids:
            fresh = not self._seen_now(namespace, id)
            if fresh:
                self._marks[namespace, id] = None
                self._marks.update(((other, id), None) for other in also)
            new.append(fresh)
        added, repeated = sum(new), len(new) - sum(new)
        if added:
            self._counters[counter] = self._counters.get(counter, 0) + added
        for name in repeats if repeated else ():
            self._counters[name] = self._counters.get(name, 0) + repeated
        return new

    def _seen_now(self, namespace: str, id: str) -> bool:
        key = (namespace, id)
        return key in self._marks and self._live(self._marks[key])

    async def seen(self, namespace: str, id: str) -> bool:
        return self._seen_now(namespace, id)

    async def put_field(self, key: str, field: str, value: bytes, ttl_s: float | None) -> None:
        await self.put_fields(key, {field: value}, ttl_s)

    async def put_fields(self, key: str, fields: Mapping[str, bytes], ttl_s: float | None) -> int:
        deadline = self._deadline(ttl_s)
        current = self._live_fields(key)
        current.update((field, bytes(value)) for field, value in fields.items())
        self._buffers[key] = (current, deadline)
        return len(current)

    async def merge_fields(
        self, key: str, fields: Mapping[str, bytes], ttl_s: float | None, *,
        if_absent: Mapping[str, bytes] | None = None, read: Collection[str] = (),
        unless: tuple[str, str] | None = None,
    ) -> Merged:
        if unless is not None and await self.seen(*unless):
            return Merged(0, frozenset(), {}, skipped=True)
        current = self._live_fields(key)
        current.update((field, bytes(value)) for field, value in fields.items())
        added = frozenset(field for field in (if_absent or {}) if field not in current)
        current.update((field, bytes((if_absent or {})[field])) for field in added)
        if fields or added:  # a call that wrote nothing leaves the TTL as it was
            self._buffers[key] = (current, self._deadline(ttl_s))
        return Merged(len(current), added, {name: current[name] for name in read if name in current})

    def _live_fields(self, key: str) -> dict[str, bytes]:
        """The entry's own dict (updated in place: a write costs O(1), not a copy of the entry)."""
        fields, deadline = self._buffers.get(key, ({}, None))
        return fields if self._live(deadline) else {}

    async def get_fields(self, key: str) -> dict[str, bytes]:
        return dict(self._live_fields(key))

    async def get_named(self, key: str, fields: Collection[str]) -> dict[str, bytes]:
        current = self._live_fields(key)
        return {field: current[field] for field in fields if field in current}

    async def field_names(self, key: str) -> set[str]:
        return set(self._live_fields(key))

    async def delete_field(self, key: str, field: str) -> None:
        self._live_fields(key).pop(field, None)

    async def delete(self, key: str) -> None:
        self._buffers.pop(key, None)

    async def incr(self, name: str, by: int = 1) -> int:
        self._counters[name] = self._counters.get(name, 0) + by
        return self._counters[name]

    async def get_counter(self, name: str) -> int:
        return self._counters.get(name, 0)

    async def heartbeat(self, role: str, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        check_ttl(ttl_s)
        self._sweep()
        self._workers[role, worker_id] = (encode_worker(role, worker_id, info, time.time()), self._clock() + ttl_s)

    async def workers(self, role: str | None = None) -> list[WorkerRecord]:
        live = [decode_worker(raw) for raw, deadline in self._workers.values() if self._live(deadline)]
        return by_role(live, role)

    async def close(self) -> None:
        return None
