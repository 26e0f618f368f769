"""Sharded publishing on two gloo ranks against the one-process publisher on the same batches: every
version's manifests carry the one-process digest, a worker rebuilding any version from scratch (keyframe +
delta chain) or following the deltas one by one holds the one-process weights bit for bit, and each rank
uploaded a disjoint part of the chunks — or, a rank with no blob store of its own, handed them to rank 0.

The trainers are bit-identical on two ranks (`test_fsdp_ranks.py` says why), so any difference here is the
publishing's. Between steps 2 and 3 the leader checkpoints and restores in place: the ranks' delta bases
survive it, as the one-process publisher's does (v3 is a delta on v2). A version whose upload fails is
not announced, and the next one is a delta on the last announced version (each rank's base is kept until
the leader names the new one).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from test_fsdp_ranks import CFG, GRPO, batch

from rlbus.blobs.local import LocalStore
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.errors import BlobNotFound, BlobStoreError
from rlbus.models.base import weight_tensors
from rlbus.models.policy import Policy
from rlbus.schemas import WeightVersion
from rlbus.training.config import FSDPConfig
from rlbus.training.ranks import Ranks
from rlbus.training.shard_publish import ShardPublisher, assign_owners
from rlbus.training.spawn import free_port, spawn_processes
from rlbus.training.step import OptimConfig
from rlbus.training.trainer import Trainer
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync

STEPS = 4  # v1 keyframe, v2 delta, v3 delta + keyframe, v4 delta
KEYFRAME_EVERY = 3
CHUNK_BYTES = 2048  # several chunks per rank


class Recording(LocalStore):
    """A local store that remembers the keys this process put."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.keys: list[str] = []

    async def put(self, key: str, data: bytes) -> None:
        self.keys.append(key)
        await super().put(key, data)


async def publisher(store: LocalStore) -> WeightPublisher:
    bus = MemoryBus(topic_specs())
    await bus.start()
    return WeightPublisher(bus=bus, store=store, keyframe_every=KEYFRAME_EVERY, chunk_bytes=CHUNK_BYTES)


def trainer(checkpoints: Path, *, ranks: Ranks | None = None, pub: WeightPublisher | None = None,
            shards: ShardPublisher | None = None) -> Trainer:
    torch.manual_seed(0)
    model = Policy(CFG)
    if ranks is not None:
        from rlbus.training.ranks import shard_model

        shard_model(model, ranks, FSDPConfig())
    return Trainer(model=model, optim=OptimConfig(lr=1e-2, weight_decay=0.1), grpo=GRPO, publisher=pub,
                   checkpoint_dir=checkpoints, ranks=ranks, shards=shards)


async def train(t: Trainer) -> None:
    for k in range(1, STEPS + 1):
        await t.train_on(batch(k))
        if k == 2:
            await t.save()
            await t.restore()


def rank_main(rank: int, port: int, tmp: str, follower_store: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    root = Path(tmp)
    try:
        async def main() -> None:
            store = Recording(root / "two")
            ranks = Ranks(rank=rank, world=2)
            if rank:
                shards = ShardPublisher(store=store, loop=asyncio.get_running_loop()) if follower_store else None
                t = trainer(root / "ckpt", ranks=ranks, shards=shards)
                await asyncio.to_thread(t.follow)
            else:
                t = trainer(root / "ckpt", ranks=ranks, pub=await publisher(store))
                await train(t)
                t.release()
            (root / f"keys-{rank}.json").write_text(json.dumps(store.keys))

        asyncio.run(main())
    finally:
        dist.destroy_process_group()


def two_ranks(tmp: Path, follower_store: bool) -> None:
    spawn_processes(rank_main, 2, str(tmp), follower_store, timeout_s=120)


async def manifests(store: LocalStore, version: int) -> dict[str, WeightVersion]:
    sync = WeightSync(bus=MemoryBus(topic_specs()), store=store, state={})
    out = {}
    for kind in ("delta", "keyframe"):
        try:
            out[kind] = await sync.load_manifest(version, kind)
        except BlobNotFound:
            pass
    return out


def blank(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(t.shape, dtype=torch.bfloat16) for name, t in like.items()}


@pytest.mark.parametrize("follower_store", [True, False], ids=["each-rank-uploads", "rank-0-uploads-for-rank-1"])
@pytest.mark.slow
async def test_two_ranks_publish_sharded_versions_a_worker_applies_like_one_process_versions(
    tmp_path: Path, follower_store: bool
) -> None:
    ref_pub = await publisher(LocalStore(tmp_path / "one"))
    ref = trainer(tmp_path / "ref-ckpt", pub=ref_pub)
    await train(ref)
    assert ref_pub.version == STEPS

    await asyncio.to_thread(two_ranks, tmp_path, follower_store)
    one, two = LocalStore(tmp_path / "one"), LocalStore(tmp_path / "two")
    like = weight_tensors(ref.model)

    chain = WeightSync(bus=MemoryBus(topic_specs()), store=two, state=blank(like))
    for version in range(1, STEPS + 1):
        want, got = await manifests(one, version), await manifests(two, version)
        assert want.keys() == got.keys() == ({"keyframe"} if version == 1 else
                                             {"delta", "keyframe"} if version % KEYFRAME_EVERY == 0 else {"delta"})
        for kind in want:  # the whole-model digest and every tensor's: the one-process ones
            assert got[kind].model_digest == want[kind].model_digest, (version, kind)
            assert got[kind].tensors == want[kind].tensors
            assert (got[kind].full_bytes, got[kind].base_version) == (want[kind].full_bytes, want[kind].base_version)
        # a worker following the deltas one by one (no rebuild, digest verified after each)
        assert await chain.handle(got["delta"] if "delta" in got else got["keyframe"]) and chain.version == version
        # and a worker joining at this version, from scratch: keyframe + chain of deltas
        fresh, reference = (WeightSync(bus=MemoryBus(topic_specs()), store=s, state=blank(like)) for s in (two, one))
        await fresh.rebuild(version)
        await reference.rebuild(version)
        assert fresh.digest == reference.digest == want[next(iter(want))].model_digest
        assert all(torch.equal(fresh.state[n], reference.state[n]) for n in like)
        assert all(torch.equal(chain.state[n], reference.state[n]) for n in like)
    assert chain.refused == [] and [h.rebuilt for h in chain.history] == [True] + [False] * (STEPS - 1)
    final = ref_pub.snapshot(like)  # the last version is the one-process trainer's final weights, cast
    assert all(torch.equal(chain.state[n], final[n]) for n in like)

    keys = [set(json.loads((tmp_path / f"keys-{r}.json").read_text())) for r in range(2)]
    chunks = {c.key for v in range(1, STEPS + 1) for m in (await manifests(two, v)).values() for c in m.chunks}
    uploaded = [{k for k in ks if "manifest" not in k} for ks in keys]
    assert uploaded[0] | uploaded[1] == chunks
    if follower_store:  # each rank put its own part, and the parts are disjoint
        assert uploaded[0] and uploaded[1] and not uploaded[0] & uploaded[1]
    else:  # rank 1 never touched the store: rank 0 put what rank 1 encoded
        assert uploaded[1] == set()


def test_owners_are_consecutive_runs_of_the_sorted_names_balanced_by_bytes() -> None:
    sizes = {"a": 10, "b": 10, "c": 60, "d": 10, "e": 10}
    assert assign_owners(sizes, 1) == dict.fromkeys(sizes, 0)
    assert assign_owners(sizes, 2) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}  # c's middle byte is the 50th
    assert assign_owners(sizes, 4) == {"a": 0, "b": 0, "c": 2, "d": 3, "e": 3}  # a rank may own nothing
    owners = assign_owners({f"w{i:02d}": 1 for i in range(12)}, 3)
    assert [list(owners.values()).count(r) for r in range(3)] == [4, 4, 4]
    assert list(owners.values()) == sorted(owners.values())  # runs: the manifest's rank order is name order
    assert assign_owners({"x": 0, "y": 0}, 2) == {"x": 0, "y": 0}


class Flaky(LocalStore):
    """A local store whose chunk uploads fail while ``down``."""

    down = False

    async def put(self, key: str, data: bytes) -> None:
        if self.down and "manifest" not in key:
            raise BlobStoreError(f"store down: {key}")
        await super().put(key, data)


def flaky_main(port: int, tmp: str) -> None:
    """One rank of a process group of one: publish v1, fail a version, publish again (a delta on v1)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        async def main() -> list[Any]:
            store = Flaky(Path(tmp) / "blobs")
            t = trainer(Path(tmp) / "ckpt", ranks=Ranks(rank=0, world=1), pub=await publisher(store))
            await t.train_on(batch(1))
            store.down = True
            failed = await t.train_on(batch(2))
            store.down = False
            await t.train_on(batch(2))  # still sampled by v1: v2 was never announced
            t.release()
            return [failed["published"], t.version]

        Path(tmp, "result.json").write_text(json.dumps(asyncio.run(main())))
    finally:
        dist.destroy_process_group()


async def test_a_version_a_rank_could_not_upload_is_not_announced_and_the_next_deltas_on_the_last_one(
    tmp_path: Path,
) -> None:
    proc = mp.get_context("spawn").Process(target=flaky_main, args=(free_port(), str(tmp_path)))
    proc.start()
    await asyncio.to_thread(proc.join, 120)
    assert proc.exitcode == 0
    assert json.loads((tmp_path / "result.json").read_text()) == [False, 2]
    store = LocalStore(tmp_path / "blobs")
    second = (await manifests(store, 2))["delta"]
    assert second.base_version == 1
    sync = WeightSync(bus=MemoryBus(topic_specs()), store=store, state=blank(weight_tensors(Policy(CFG))))
    await sync.rebuild(1)
    assert await sync.handle(second) and sync.version == 2 and not sync.history[-1].rebuilt  # digest verified
