"""``rlbus bench join``: rollouts per second through the trainer's join at G = 8, 32 and 128, on Redis.

A prompt asks for a group of G rollouts (G = 16–128 in real runs) and each rollout waits for a reward
from two sources (verifier and judge). The join used to re-read and decode the whole group from the state
store on every arrival to decide whether it was complete — O(G²) work per group, O(G) per rollout. It now
decides from the group's field count and field names and decodes the group once, at release
(:mod:`rlbus.training.join`). The old logic is kept here, and only here, as the same-run baseline
(:class:`BaselineJoin`); the new path is the product's :class:`~rlbus.training.join.JoinBuffer`.

Both paths get the identical arrivals, into a throwaway ``redis-server`` on loopback: per group, its G
rollouts (1,024 tokens each: int32 ids and versions, uint8 loss mask, float32 log-probs, ≈ 13 KB encoded)
and 2·G rewards, in a seeded shuffled order, groups one after another, a fresh key prefix per run. The
figures are wall time over the whole feed: rollouts/s and µs per rollout (one rollout = its own arrival
plus its two rewards' arrivals and its share of the release). Each run checks that both paths released the
same groups — the same rollout ids with the same rewards.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlbus.schemas import Reward, Rollout, TensorData, decode, encode
from rlbus.state.base import StateStore
from rlbus.state.redis import RedisStateStore
from rlbus.training.join import JoinBuffer, RewardPolicy, ScoredGroup, ScoredRollout
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json
from rlbus_tools.services.redis import start_redis

SIZES = (8, 32, 128)
SOURCES = ("verifier", "judge")
TOKENS = 1024
#: Rollouts fed per G: full run, quick run (whole groups at every G).
ROLLOUTS = 1024
QUICK_ROLLOUTS = 128

Event = Rollout | Reward
Released = list[tuple[str, list[tuple[str, float]]]]


class BaselineJoin:
    """The join's readiness logic before it was decided from field names, kept as the benchmark's
    baseline: every arrival reads the whole group back and decodes every rollout and reward in it."""

    def __init__(self, *, state: StateStore, policy: RewardPolicy, namespace: str = "join") -> None:
        self._state = state
        self.policy = policy
        self._ns = namespace
        self._ttl = max(policy.timeout_s * 4, 60.0)

    def _group_key(self, prompt_id: str) -> str:
        return f"{self._ns}:group:{prompt_id}"

    async def _entry(self, prompt_id: str) -> tuple[dict[str, bytes], dict[str, float]]:
        fields = await self._state.get_fields(self._group_key(prompt_id))
        if "meta" in fields:
            return fields, json.loads(fields["meta"])
        now = time.time()
        await self._state.put_field(f"{self._ns}:open", prompt_id, str(now).encode(), None)
        return fields, {"first_seen": now}

    async def _put(self, prompt_id: str, fields: dict[str, bytes], name: str, value: bytes) -> None:
        await self._state.put_field(self._group_key(prompt_id), name, value, self._ttl)
        fields[name] = value

    async def add_rollout(self, rollout: Rollout) -> ScoredGroup | None:
        if await self._state.seen("outcome", rollout.rollout_id):
            return None
        fields, meta = await self._entry(rollout.prompt_id)
        if f"r:{rollout.rollout_id}" in fields:
            return None
        if "meta" not in fields or meta.get("group_size") != rollout.group_size:
            meta["group_size"] = rollout.group_size
            await self._put(rollout.prompt_id, fields, "meta", json.dumps(meta).encode())
        await self._put(rollout.prompt_id, fields, f"r:{rollout.rollout_id}", encode(rollout))
        return await self._ready(rollout.prompt_id, fields)

    async def add_reward(self, reward: Reward) -> ScoredGroup | None:
        if reward.source not in self.policy.sources or await self._state.seen("outcome", reward.rollout_id):
            return None
        fields, meta = await self._entry(reward.prompt_id)
        if "meta" not in fields:
            await self._put(reward.prompt_id, fields, "meta", json.dumps(meta).encode())
        copy = "" if reward.rollout_created_at is None else repr(reward.rollout_created_at)
        await self._put(reward.prompt_id, fields, f"w:{reward.rollout_id}:{reward.source}:{copy}", encode(reward))
        return await self._ready(reward.prompt_id, fields)

    def _assemble(self, prompt_id: str, fields: dict[str, bytes]) -> tuple[ScoredGroup, int | None]:
        meta = json.loads(fields.get("meta", b"{}"))
        rollouts = {k[2:]: decode(Rollout, v) for k, v in fields.items() if k.startswith("r:")}
        rewards: dict[str, dict[str, Reward]] = {}
        for k, v in fields.items():
            if k.startswith("w:"):
                rollout_id, source, copy = k[2:].rsplit(":", 2)
                rollout = rollouts.get(rollout_id)
                if copy and rollout is not None and copy != repr(rollout.created_at):
                    continue
                rewards.setdefault(rollout_id, {})[source] = decode(Reward, v)
        scored, unscored = [], []
        for rollout_id, rollout in sorted(rollouts.items(), key=lambda kv: kv[1].group_index):
            got = rewards.get(rollout_id, {})
            if all(source in got for source in self.policy.sources):
                components = {f"{s}.{name}": value for s, r in got.items() for name, value in r.components.items()}
                components.update({s: got[s].value for s in self.policy.sources})
                scored.append(ScoredRollout(rollout, self.policy.combine(got), components))
            else:
                unscored.append(rollout_id)
        return ScoredGroup(prompt_id, scored, unscored), meta.get("group_size")

    async def _ready(self, prompt_id: str, fields: dict[str, bytes]) -> ScoredGroup | None:
        group, size = self._assemble(prompt_id, fields)
        if size is None or len(group.rollouts) < size:
            return None
        await self._state.delete(self._group_key(prompt_id))
        await self._state.delete_field(f"{self._ns}:open", prompt_id)
        return group


def make_events(size: int, groups: int, *, seed: int) -> list[Event]:
    """``groups`` groups of ``size`` rollouts and their rewards from :data:`SOURCES`, each group's
    arrivals in a seeded shuffled order."""
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    events: list[Event] = []
    for g in range(groups):
        prompt_id = f"g{size}-p{g}"
        group: list[Event] = []
        for i in range(size):
            prompt_len = 128
            mask = np.zeros(TOKENS, dtype=np.uint8)
            mask[prompt_len:] = 1
            created = 1.7e9 + g + i / 1000
            group.append(Rollout(
                rollout_id=f"{prompt_id}-r{i}", prompt_id=prompt_id, group_index=i, group_size=size,
                token_ids=TensorData.from_numpy(gen.integers(0, 50_000, TOKENS, dtype=np.int32)),
                loss_mask=TensorData.from_numpy(mask),
                logprobs=TensorData.from_numpy(np.where(mask > 0, -gen.random(TOKENS), 0.0).astype(np.float32)),
                token_versions=TensorData.from_numpy(np.where(mask > 0, 3, -1).astype(np.int32)),
                created_at=created,
            ))
            group += [
                Reward(reward_id=uuid.uuid4().hex, rollout_id=f"{prompt_id}-r{i}", prompt_id=prompt_id,
                       source=source, value=rng.random(), components={"score": rng.random()},
                       rollout_created_at=created)
                for source in SOURCES
            ]
        rng.shuffle(group)
        events += group
    return events


async def feed(join: BaselineJoin | JoinBuffer, events: list[Event]) -> tuple[float, Released]:
    """Wall seconds to push ``events`` through ``join``, and what it released (prompt, [(id, reward)])."""
    released: Released = []
    started = time.perf_counter()
    for event in events:
        group = await (join.add_rollout(event) if isinstance(event, Rollout) else join.add_reward(event))
        if group is not None:
            released.append((group.prompt_id, [(s.rollout.rollout_id, s.reward) for s in group.rollouts]))
    return time.perf_counter() - started, released


async def measure(url: str, size: int, rollouts: int, *, seed: int) -> dict[str, Any]:
    """Both paths at one G on the Redis at ``url``; each run on a fresh key prefix."""
    groups = max(1, rollouts // size)
    events = make_events(size, groups, seed=seed + size)
    policy = RewardPolicy(sources=SOURCES)
    paths: dict[str, Callable[[StateStore], BaselineJoin | JoinBuffer]] = {
        "old": lambda state: BaselineJoin(state=state, policy=policy),
        "new": lambda state: JoinBuffer(state=state, policy=policy),
    }
    figures: dict[str, Any] = {}
    released: dict[str, Released] = {}
    for name, build in paths.items():
        async with RedisStateStore.from_url(url, key_prefix=f"bench-join:{uuid.uuid4().hex[:8]}:") as state:
            wall, released[name] = await feed(build(state), events)
        n = groups * size
        figures[name] = {"wall_s": wall, "rollouts_per_s": n / wall, "per_rollout_us": wall / n * 1e6,
                         "groups_released": len(released[name])}
    return {
        "groups": groups,
        "rollouts": groups * size,
        **figures,
        "speedup": figures["new"]["rollouts_per_s"] / figures["old"]["rollouts_per_s"],
        "same_groups": released["old"] == released["new"] and len(released["new"]) == groups,
    }


async def _run(seed: int, sizes: tuple[int, ...], rollouts: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-join-") as home, start_redis(dir=Path(home)) as redis:
        by_g = {str(size): await measure(redis.url, size, rollouts, seed=seed) for size in sizes}
    return {"by_g": by_g, "config": {"sizes": list(sizes), "sources": list(SOURCES), "tokens": TOKENS,
                                     "rollouts_per_g": rollouts, "seed": seed, "store": "redis"}}


def run(quick: bool, json_path: Path | None, seed: int = 0, sizes: tuple[int, ...] = SIZES,
        rollouts: int | None = None) -> dict[str, Any]:
    n = rollouts if rollouts is not None else QUICK_ROLLOUTS if quick else ROLLOUTS
    result = asyncio.run(_run(seed, sizes, n))
    by_g = result["by_g"]
    first, last = by_g[str(sizes[0])], by_g[str(sizes[-1])]
    result["summary"] = {
        **{f"speedup_g{g}": f["speedup"] for g, f in by_g.items()},
        "new_per_rollout_us_ratio": last["new"]["per_rollout_us"] / first["new"]["per_rollout_us"],
        "old_per_rollout_us_ratio": last["old"]["per_rollout_us"] / first["old"]["per_rollout_us"],
        "same_groups": all(f["same_groups"] for f in by_g.values()),
    }
    result["meta"] = {**meta(), "quick": quick}
    print_table(
        f"rlbus bench join — Redis, {len(SOURCES)} reward sources, {TOKENS}-token rollouts, {n} rollouts per G",
        ["G", "old rollouts/s", "old µs/rollout", "new rollouts/s", "new µs/rollout", "speedup", "same groups"],
        [[int(g), f["old"]["rollouts_per_s"], f["old"]["per_rollout_us"], f["new"]["rollouts_per_s"],
          f["new"]["per_rollout_us"], f["speedup"], "yes" if f["same_groups"] else "NO"] for g, f in by_g.items()],
    )
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """The trainer's join: throughput and latency as groups grow."""
    run(quick=quick, json_path=json_path)
