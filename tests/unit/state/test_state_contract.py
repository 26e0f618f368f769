"""One contract for every StateStore: each test runs against the in-memory store and real Redis.

The Redis runs come from the session ``redis_url`` fixture (tests/fixtures/redis.py) and fail when
no Redis can be reached or started. Each test gets its own key prefix, deleted afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from rlbus.errors import ConfigError, StateError
from rlbus.state import MemoryStateStore, RedisStateStore, StateStore, open_state_store

TTL = 0.3
PAST_TTL = 0.6

StoreFactory = Callable[[], StateStore]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Builds stores for one test; Redis stores get distinct prefixes on one server."""
    made: list[StateStore] = []
    prefixes: list[str] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def build() -> StateStore:
        if url is None:
            store: StateStore = MemoryStateStore()
        else:
            prefixes.append(f"test:{uuid.uuid4().hex[:12]}:")
            store = RedisStateStore.from_url(url, key_prefix=prefixes[-1])
        made.append(store)
        return store

    yield build
    for store in made:
        await store.close()
    if url is not None:
        await _delete_prefixes(url, prefixes)


async def _delete_prefixes(url: str, prefixes: list[str]) -> None:
    client = Redis.from_url(url)
    for prefix in prefixes:
        keys = [key async for key in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def store(make_store: StoreFactory) -> StateStore:
    return make_store()


async def test_mark_once_is_true_only_the_first_time(store: StateStore) -> None:
    assert not await store.seen("trained", "r1")
    assert await store.mark_once("trained", "r1")
    assert not await store.mark_once("trained", "r1")
    assert await store.seen("trained", "r1")


async def test_mark_once_namespaces_are_independent(store: StateStore) -> None:
    assert await store.mark_once("trained", "r1")
    assert await store.mark_once("rewarded", "r1")
    assert not await store.seen("dropped", "r1")


async def test_mark_once_is_atomic_under_concurrency(store: StateStore) -> None:
    results = await asyncio.gather(*(store.mark_once("trained", "same") for _ in range(20)))
    assert sum(results) == 1


async def test_mark_once_expires_after_ttl(store: StateStore) -> None:
    assert await store.mark_once("trained", "r1", ttl_s=TTL)
    await asyncio.sleep(PAST_TTL)
    assert not await store.seen("trained", "r1")
    assert await store.mark_once("trained", "r1", ttl_s=TTL)


async def test_mark_once_counted_marks_counts_and_counts_repeats(store: StateStore) -> None:
    assert await store.mark_once("final", "old")
    new = await store.mark_once_counted("final", ["a", "old", "b", "a"], also=["trained", "audit"],
                                        counter="outcome:trained", repeats=["outcome:duplicate", "again"])
    assert new == [True, False, True, False]  # an id twice in one call is new once
    assert [await store.seen("trained", i) for i in ("a", "b", "old")] == [True, True, False]
    assert await store.seen("audit", "b") and not await store.seen("audit", "old")
    assert await store.get_counter("outcome:trained") == 2
    assert (await store.get_counter("outcome:duplicate"), await store.get_counter("again")) == (2, 2)
    assert await store.mark_once_counted("final", [], counter="outcome:trained") == []
    assert await store.mark_once_counted("final", ["c"], counter="outcome:stale", repeats=["outcome:duplicate"])
    assert (await store.get_counter("outcome:stale"), await store.get_counter("outcome:duplicate")) == (1, 2)


async def test_mark_once_counted_is_atomic_under_concurrency(store: StateStore) -> None:
    results = await asyncio.gather(*(store.mark_once_counted("final", ["x", "y"], counter="n", repeats=["dup"])
                                     for _ in range(10)))
    assert sum(sum(r) for r in results) == 2
    assert (await store.get_counter("n"), await store.get_counter("dup")) == (2, 18)


async def test_fields_round_trip_arbitrary_bytes(store: StateStore) -> None:
    payload = bytes(range(256))
    await store.put_field("join:r1", "rollout", payload, ttl_s=None)
    await store.put_field("join:r1", "reward/verifier", b"\x00", ttl_s=None)
    assert await store.get_fields("join:r1") == {"rollout": payload, "reward/verifier": b"\x00"}


async def test_put_field_overwrites_one_field(store: StateStore) -> None:
    await store.put_field("k", "a", b"1", ttl_s=None)
    await store.put_field("k", "b", b"2", ttl_s=None)
    await store.put_field("k", "a", b"3", ttl_s=None)
    assert await store.get_fields("k") == {"a": b"3", "b": b"2"}


async def test_missing_entry_has_no_fields(store: StateStore) -> None:
    assert await store.get_fields("nothing") == {}
    assert await store.field_names("nothing") == set()
    assert await store.get_named("nothing", ["a"]) == {}


async def test_put_fields_sets_several_and_returns_the_field_count(store: StateStore) -> None:
    assert await store.put_fields("k", {"a": b"1", "b": bytes(range(256))}, ttl_s=None) == 2
    assert await store.put_fields("k", {"a": b"3"}, ttl_s=None) == 2  # an overwrite adds no field
    assert await store.put_fields("k", {"c": b""}, ttl_s=None) == 3
    assert await store.put_fields("k", {}, ttl_s=None) == 3
    await store.put_field("k", "d", b"4", ttl_s=None)
    assert await store.get_fields("k") == {"a": b"3", "b": bytes(range(256)), "c": b"", "d": b"4"}


async def test_merge_fields_keeps_the_first_writer_of_if_absent_fields(store: StateStore) -> None:
    first = await store.merge_fields("k", {"w": b"1"}, None, if_absent={"meta": b"A", "r:x": b"x1"}, read=["meta"])
    assert (first.size, first.added, first.read) == (3, frozenset({"meta", "r:x"}), {"meta": b"A"})
    again = await store.merge_fields("k", {"w": b"2"}, None, if_absent={"meta": b"B", "r:x": b"x2", "r:y": b"y"},
                                     read=["meta", "r:x", "absent"])
    assert (again.size, again.added) == (4, frozenset({"r:y"}))
    assert again.read == {"meta": b"A", "r:x": b"x1"}  # the first writer's values stay; ``fields`` overwrite
    assert await store.get_fields("k") == {"w": b"2", "meta": b"A", "r:x": b"x1", "r:y": b"y"}
    plain = await store.merge_fields("k", {}, None)
    assert (plain.size, plain.added, plain.read) == (4, frozenset(), {})


async def test_merge_fields_writes_nothing_for_a_marked_id(store: StateStore) -> None:
    assert not (await store.merge_fields("k", {"w": b"1"}, None, unless=("final", "r1"))).skipped
    assert await store.mark_once("final", "r1")
    blocked = await store.merge_fields("k", {"w": b"2"}, None, if_absent={"x": b"3"}, read=["w"],
                                       unless=("final", "r1"))
    assert blocked.skipped and (blocked.size, blocked.added, blocked.read) == (0, frozenset(), {})
    assert await store.get_fields("k") == {"w": b"1"}


async def test_merge_fields_restarts_the_ttl(store: StateStore) -> None:
    ttl = 1.0
    await store.merge_fields("t", {}, ttl, if_absent={"a": b"1"})
    await asyncio.sleep(ttl / 2)
    await store.merge_fields("t", {"b": b"2"}, ttl)
    await asyncio.sleep(ttl / 2 + 0.1)
    assert await store.field_names("t") == {"a", "b"}
    await asyncio.sleep(ttl)
    assert (await store.merge_fields("t", {"c": b"3"}, None)).size == 1  # the expired fields are gone
    assert (await store.merge_fields("t", {}, ttl, if_absent={"c": b"4"})).added == frozenset()
    await asyncio.sleep(ttl + 0.4)
    assert await store.field_names("t") == {"c"}  # writing nothing set no TTL on the persistent entry


async def test_field_names_and_named_fields(store: StateStore) -> None:
    await store.put_fields("k", {"meta": b"{}", "r:x": b"big", "c:x:1.5": b""}, ttl_s=None)
    assert await store.field_names("k") == {"meta", "r:x", "c:x:1.5"}
    assert await store.get_named("k", ["meta", "r:y"]) == {"meta": b"{}"}
    assert await store.get_named("k", []) == {}
    await store.delete_field("k", "r:x")
    assert await store.field_names("k") == {"meta", "c:x:1.5"}
    await store.delete("k")
    assert await store.field_names("k") == set()


async def test_get_fields_returns_a_copy(store: StateStore) -> None:
    await store.put_field("k", "a", b"1", ttl_s=None)
    fields = await store.get_fields("k")
    fields["b"] = b"2"
    assert await store.get_fields("k") == {"a": b"1"}


async def test_delete_drops_the_entry_and_tolerates_absence(store: StateStore) -> None:
    await store.put_field("k", "a", b"1", ttl_s=None)
    await store.delete("k")
    await store.delete("k")
    assert await store.get_fields("k") == {}


async def test_delete_field_removes_only_that_field(store: StateStore) -> None:
    await store.put_field("k", "a", b"1", ttl_s=None)
    await store.put_field("k", "b", b"2", ttl_s=None)
    await store.delete_field("k", "a")
    await store.delete_field("k", "missing")
    await store.delete_field("absent", "a")
    assert await store.get_fields("k") == {"b": b"2"}


async def test_fields_expire_after_the_latest_put(store: StateStore) -> None:
    ttl = 1.0  # the check in between has 0.4 s of margin either way: enough for a loaded CI machine
    await store.put_field("k", "a", b"1", ttl_s=ttl)
    await asyncio.sleep(ttl / 2)
    await store.put_field("k", "b", b"2", ttl_s=ttl)
    await asyncio.sleep(ttl / 2 + 0.1)  # past a's own TTL, within the latest put's
    assert await store.get_fields("k") == {"a": b"1", "b": b"2"}
    await asyncio.sleep(ttl)
    assert await store.get_fields("k") == {}
    assert await store.field_names("k") == set()


async def test_put_fields_restarts_the_ttl(store: StateStore) -> None:
    ttl = 1.0
    assert await store.put_fields("k", {"a": b"1"}, ttl_s=ttl) == 1
    await asyncio.sleep(ttl / 2)
    assert await store.put_fields("k", {"b": b"2"}, ttl_s=ttl) == 2
    await asyncio.sleep(ttl / 2 + 0.1)
    assert await store.field_names("k") == {"a", "b"}
    await asyncio.sleep(ttl)
    assert await store.put_fields("k", {"c": b"3"}, ttl_s=None) == 1  # the expired fields are gone
    assert await store.get_fields("k") == {"c": b"3"}


async def test_counters_start_at_zero_and_add(store: StateStore) -> None:
    assert await store.get_counter("trained") == 0
    assert await store.incr("trained") == 1
    assert await store.incr("trained", by=5) == 6
    assert await store.incr("trained", by=-2) == 4
    assert await store.get_counter("trained") == 4
    assert await store.get_counter("dropped") == 0


async def test_counters_are_atomic_under_concurrency(store: StateStore) -> None:
    await asyncio.gather(*(store.incr("n") for _ in range(50)))
    assert await store.get_counter("n") == 50


async def test_workers_are_listed_by_role_in_order(store: StateStore) -> None:
    await store.heartbeat("rollout", "w2", {"region": "eu"}, ttl_s=10)
    await store.heartbeat("rollout", "w1", {"region": "us", "gpus": [0, 1]}, ttl_s=10)
    await store.heartbeat("trainer", "t1", {}, ttl_s=10)
    everyone = await store.workers()
    assert [(w["role"], w["worker_id"]) for w in everyone] == [("rollout", "w1"), ("rollout", "w2"), ("trainer", "t1")]
    rollout = await store.workers("rollout")
    assert [w["info"] for w in rollout] == [{"region": "us", "gpus": [0, 1]}, {"region": "eu"}]
    assert all(w["last_seen"] > 0 for w in everyone)
    assert await store.workers("reward") == []


async def test_heartbeat_replaces_info(store: StateStore) -> None:
    await store.heartbeat("rollout", "w1", {"version": 1}, ttl_s=10)
    await store.heartbeat("rollout", "w1", {"version": 2}, ttl_s=10)
    assert [w["info"] for w in await store.workers()] == [{"version": 2}]


async def test_workers_disappear_when_heartbeats_stop(store: StateStore) -> None:
    await store.heartbeat("rollout", "gone", {}, ttl_s=TTL)
    await store.heartbeat("rollout", "alive", {}, ttl_s=10)
    await asyncio.sleep(PAST_TTL)
    assert [w["worker_id"] for w in await store.workers()] == ["alive"]
    await store.heartbeat("rollout", "gone", {}, ttl_s=10)
    assert [w["worker_id"] for w in await store.workers()] == ["alive", "gone"]


async def test_stores_do_not_see_each_other(make_store: StoreFactory) -> None:
    first, second = make_store(), make_store()
    await first.mark_once("trained", "r1")
    await first.put_field("k", "a", b"1", ttl_s=None)
    await first.incr("n")
    await first.heartbeat("rollout", "w1", {}, ttl_s=10)
    assert not await second.seen("trained", "r1")
    assert await second.get_fields("k") == {}
    assert await second.get_counter("n") == 0
    assert await second.workers() == []


@pytest.mark.parametrize("ttl_s", [0, -1.0])
async def test_non_positive_ttls_are_rejected(store: StateStore, ttl_s: float) -> None:
    with pytest.raises(ValueError):
        await store.mark_once("trained", "r1", ttl_s=ttl_s)
    with pytest.raises(ValueError):
        await store.put_field("k", "a", b"1", ttl_s=ttl_s)
    with pytest.raises(ValueError):
        await store.put_fields("k", {"a": b"1"}, ttl_s=ttl_s)
    with pytest.raises(ValueError):
        await store.heartbeat("rollout", "w1", {}, ttl_s=ttl_s)


async def test_store_is_an_async_context_manager(make_store: StoreFactory) -> None:
    async with make_store() as store:
        assert await store.incr("n") == 1
    await store.close()


async def test_redis_failures_become_state_errors() -> None:
    store = RedisStateStore.from_url("redis://127.0.0.1:1/0")
    with pytest.raises(StateError, match="redis incr failed"):
        await store.incr("n")
    await store.close()


def test_open_state_store_picks_the_implementation() -> None:
    assert isinstance(open_state_store("memory://"), MemoryStateStore)
    assert isinstance(open_state_store("redis://127.0.0.1:6379/0"), RedisStateStore)


def test_open_state_store_rejects_unknown_urls() -> None:
    with pytest.raises(ConfigError, match="state_url"):
        open_state_store("postgres://db")
