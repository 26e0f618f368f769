"""Redis StateStore for real runs, where many worker processes share the loop's state.

Every key starts with ``key_prefix`` so several runs can share one Redis::

    <prefix>once:<namespace>:<id>      string, SET NX [PX ttl]          idempotency ledger
    <prefix>buf:<key>                  hash of field -> bytes [PX ttl]  join buffer (HSET/HLEN, HKEYS)
    <prefix>ctr:<name>                 integer (INCRBY)                 counters
    <prefix>worker:<role>:<id>         JSON WorkerRecord, PX ttl        worker registry entry
    <prefix>workers                    set of worker entry keys         registry index

Expiry runs on the Redis server's clock, so workers on machines whose clocks disagree still age out
correctly. With ``reconnect=True`` (what :func:`rlbus.state.open_state_store` gives real runs) a
lost connection is retried with capped exponential backoff for about half a minute (:data:`RECONNECT`),
so a Redis restart pauses the workers instead of failing them; without it redis-py's default (a few
retries, about a second) applies. Every Redis failure that remains is raised as
:class:`rlbus.errors.StateError`. The ledger must not
be evicted: run Redis with ``maxmemory-policy noeviction`` (the default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlbus.errors import StateError
from rlbus.state.base import (
    Merged,
    StateStore,
    WorkerRecord,
    by_role,
    check_ttl,
    decode_worker,
    encode_worker,
)

DEFAULT_PREFIX = "rlbus:"
#: Reconnect policy: 40 tries, backoff 50 ms doubling to at most 1 s, with jitter (~30 s in all).
RECONNECT = Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries=40)


@contextmanager
def _translate(operation: str) -> Iterator[None]:
    try:
        yield
    except RedisError as exc:
        raise StateError(f"redis {operation} failed: {exc}") from exc


def _ms(ttl_s: float | None) -> int | None:
    check_ttl(ttl_s)
    return None if ttl_s is None else max(1, math.ceil(ttl_s * 1000))


#: `StateStore.merge_fields` on the server. KEYS[1] the hash, KEYS[2] (optional) the ``unless`` mark; ARGV:
#: TTL in ms (0: none), then the counts of fields to set, fields to set where absent and fields to read,
#: then the name/value pairs and the names. Returns {field count, names set where absent, values read (nil
#: where absent)}, or {-1, {}, {}} when the mark exists (nothing written).
MERGE_SCRIPT = """
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then return {-1, {}, {}} end
local key, ttl = KEYS[1], tonumber(ARGV[1])
local nset, nabsent, nread = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local i = 5
if nset > 0 then
  local pairs = {}
  for _ = 1, nset do pairs[#pairs + 1] = ARGV[i]; pairs[#pairs + 1] = ARGV[i + 1]; i = i + 2 end
  redis.call('HSET', key, unpack(pairs))
end
local added = {}
for _ = 1, nabsent do
  if redis.call('HSETNX', key, ARGV[i], ARGV[i + 1]) == 1 then added[#added + 1] = ARGV[i] end
  i = i + 2
end
if nset + #added > 0 then
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) else redis.call('PERSIST', key) end
end
local size = redis.call('HLEN', key)
local values = {}
if nread > 0 then
  local names = {}
  for _ = 1, nread do names[#names + 1] = ARGV[i]; i = i + 1 end
  values = redis.call('HMGET', key, unpack(names))
end
return {size, added, values}
"""


#: `StateStore.mark_once_counted` on the server. KEYS: the n gate keys, then the n keys of each ``also``
#: namespace, then the counter, then the ``repeats`` counters; ARGV[1] = n, ARGV[2] = len(also). Returns 1/0
#: per id (new / already marked).
LEDGER_SCRIPT = """
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local new, fresh = {}, 0
for i = 1, n do
  if redis.call('SET', KEYS[i], '1', 'NX') then
    new[i] = 1
    fresh = fresh + 1
    for j = 1, m do redis.call('SET', KEYS[n * j + i], '1') end
  else
    new[i] = 0
  end
end
local counter = n * (m + 1) + 1
if fresh > 0 then redis.call('INCRBY', KEYS[counter], fresh) end
if fresh < n then
  for k = counter + 1, #KEYS do redis.call('INCRBY', KEYS[k], n - fresh) end
end
return new
"""


class RedisStateStore(StateStore):
    """A StateStore on ``redis.asyncio``; it owns ``client`` (bytes responses) and closes it."""

    def __init__(self, client: Redis, *, key_prefix: str = DEFAULT_PREFIX) -> None:
        self._client = client
        self._prefix = key_prefix
        self._merge = client.register_script(MERGE_SCRIPT)
        self._ledger = client.register_script(LEDGER_SCRIPT)

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = DEFAULT_PREFIX, reconnect: bool = False) -> RedisStateStore:
        """A store on the Redis at ``url`` (``redis://host:port/db``); connects on first use and, with
        ``reconnect``, rides out a restart per :data:`RECONNECT`."""
        if not reconnect:
            return cls(Redis.from_url(url), key_prefix=key_prefix)
        client = Redis.from_url(url, retry=RECONNECT, retry_on_error=[RedisConnectionError, RedisTimeoutError])
        return cls(client, key_prefix=key_prefix)

    def _key(self, kind: str, *parts: str) -> str:
        return self._prefix + ":".join((kind, *parts))

    async def mark_once(self, namespace: str, id: str, ttl_s: float | None = None) -> bool:
        with _translate("mark_once"):
            return bool(await self._client.set(self._key("once", namespace, id), b"1", nx=True, px=_ms(ttl_s)))

    async def mark_once_counted(
        self, namespace: str, ids: Sequence[str], *, counter: str, also: Sequence[str] = (),
        repeats: Sequence[str] = (),
    ) -> list[bool]:
        """One server-side script (`LEDGER_SCRIPT`): Redis runs a script whole, and its AOF holds it as one
        transaction, so a crash of the caller or of Redis leaves all of its writes or none."""
        if not ids:
            return []
        keys = [self._key("once", ns, id) for ns in (namespace, *also) for id in ids]
        keys += [self._key("ctr", name) for name in (counter, *repeats)]
        with _translate("mark_once_counted"):
            new = await self._ledger(keys=keys, args=[len(ids), len(also)])
        return [bool(flag) for flag in new]

    async def seen(self, namespace: str, id: str) -> bool:
        with _translate("seen"):
            return bool(await self._client.exists(self._key("once", namespace, id)))

    async def put_field(self, key: str, field: str, value: bytes, ttl_s: float | None) -> None:
        await self._put(key, {field: value}, ttl_s, "put_field", count=False)

    async def put_fields(self, key: str, fields: Mapping[str, bytes], ttl_s: float | None) -> int:
        return await self._put(key, fields, ttl_s, "put_fields", count=True)

    async def _put(self, key: str, fields: Mapping[str, bytes], ttl_s: float | None, operation: str, *,
                   count: bool) -> int:
        """HSET, the TTL, and (``count``) HLEN in one transaction: one round trip."""
        name, ttl_ms = self._key("buf", key), _ms(ttl_s)
        with _translate(operation):
            async with self._client.pipeline(transaction=True) as pipe:
                if fields:
                    pipe.hset(name, mapping=cast(dict[Any, Any], dict(fields)))  # redis-py types mapping invariantly
                if ttl_ms is None:
                    pipe.persist(name)
                else:
                    pipe.pexpire(name, ttl_ms)
                if count:
                    pipe.hlen(name)
                replies = await pipe.execute()
        return int(replies[-1]) if count else 0

    async def merge_fields(
        self, key: str, fields: Mapping[str, bytes], ttl_s: float | None, *,
        if_absent: Mapping[str, bytes] | None = None, read: Collection[str] = (),
        unless: tuple[str, str] | None = None,
    ) -> Merged:
        """One server-side script (`MERGE_SCRIPT`): a single command and a single reply, where a MULTI of
        the same commands costs a parsed reply each — at G = 128 that parsing was most of an arrival."""
        first, names, ttl_ms = list((if_absent or {}).items()), list(read), _ms(ttl_s)
        args: list[Any] = [ttl_ms or 0, len(fields), len(first), len(names)]
        for field, value in [*fields.items(), *first]:
            args += [field, value]
        args += names
        keys = [self._key("buf", key), *([self._key("once", *unless)] if unless is not None else [])]
        with _translate("merge_fields"):
            size, added, values = await self._merge(keys=keys, args=args)
        if size < 0:
            return Merged(0, frozenset(), {}, skipped=True)
        return Merged(int(size), frozenset(a.decode() for a in added),
                      {n: v for n, v in zip(names, values, strict=True) if v is not None})

    async def get_fields(self, key: str) -> dict[str, bytes]:
        with _translate("get_fields"):
            fields = cast(dict[bytes, bytes], await self._client.hgetall(self._key("buf", key)))
        return {field.decode(): value for field, value in fields.items()}

    async def get_named(self, key: str, fields: Collection[str]) -> dict[str, bytes]:
        names = list(fields)
        if not names:
            return {}
        with _translate("get_named"):
            values = cast(list[bytes | None], await self._client.hmget(self._key("buf", key), names))
        return {name: value for name, value in zip(names, values, strict=True) if value is not None}

    async def field_names(self, key: str) -> set[str]:
        with _translate("field_names"):
            names = cast(list[bytes], await self._client.hkeys(self._key("buf", key)))
        return {name.decode() for name in names}

    async def delete_field(self, key: str, field: str) -> None:
        with _translate("delete_field"):
            await self._client.hdel(self._key("buf", key), field)

    async def delete(self, key: str) -> None:
        with _translate("delete"):
            await self._client.delete(self._key("buf", key))

    async def incr(self, name: str, by: int = 1) -> int:
        with _translate("incr"):
            return int(await self._client.incrby(self._key("ctr", name), by))

    async def get_counter(self, name: str) -> int:
        with _translate("get_counter"):
            value = await self._client.get(self._key("ctr", name))
        return 0 if value is None else int(value)

    async def heartbeat(self, role: str, worker_id: str, info: dict[str, Any], ttl_s: float) -> None:
        entry, ttl_ms = self._key("worker", role, worker_id), _ms(ttl_s)
        record = encode_worker(role, worker_id, info, time.time())
        with _translate("heartbeat"):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(entry, record, px=ttl_ms)
                pipe.sadd(self._key("workers"), entry)
                await pipe.execute()

    async def workers(self, role: str | None = None) -> list[WorkerRecord]:
        index = self._key("workers")
        with _translate("workers"):
            entries = sorted(await self._client.smembers(index))
            values = await self._client.mget(entries) if entries else []
            expired = [entry for entry, value in zip(entries, values, strict=True) if value is None]
            # A worker that heartbeats between MGET and SREM drops out of the index until its next
            # heartbeat re-adds it; tolerable for a registry that is refreshed every few seconds.
            if expired:
                await self._client.srem(index, *expired)
        return by_role([decode_worker(value) for value in values if value is not None], role)

    async def close(self) -> None:
        with _translate("close"):
            await self._client.aclose()
