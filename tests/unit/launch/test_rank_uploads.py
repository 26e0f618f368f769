"""`rlbus worker trainer` on two ranks with ``[trainer] rank_uploads = true``: rank 1 opens the blob store
itself and uploads the chunks of the tensors it owns, still never touching the bus or the state store;
the first version's manifest lists both ranks' chunks, and a worker rebuilding it holds the weights."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_ranks import SHAPE, forbidden

from rlbus.blobs.local import LocalStore
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.launch.config import RunConfig, config_from_dict
from rlbus.models.base import weight_tensors
from rlbus.training.spawn import spawn_processes
from rlbus.weights.sync import WeightSync


def run_config(tmp: Path) -> RunConfig:
    return config_from_dict({
        "state": {"url": "memory://"}, "store": {"dir": str(tmp / "blobs")}, "model": SHAPE,
        "trainer": {"world_size": 2, "warm_steps": 0, "rank_uploads": True},
    }, {})


def rank_main(rank: int, port: int, tmp: str) -> None:
    import rlbus.launch.roles as roles

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    config = run_config(Path(tmp))
    stop = asyncio.Event()
    if rank:
        for name in ("connected", "bus_for", "state_for"):
            setattr(roles, name, forbidden)
        opened = roles.store_for
        keys: list[str] = []

        def store_for(*args: Any, **kwargs: Any) -> Any:  # record what rank 1 puts
            store, url = opened(*args, **kwargs)
            put = store.put

            async def recording(key: str, data: bytes) -> None:
                keys.append(key)
                await put(key, data)

            store.put = recording  # type: ignore[method-assign]
            return store, url

        roles.store_for = store_for  # type: ignore[attr-defined]
        asyncio.run(roles.trainer_main(config, worker_id="trainer", stop=stop))
        (Path(tmp) / "rank1.json").write_text(json.dumps(keys))
        return

    async def lead() -> None:
        from rlbus.state.memory import MemoryStateStore

        asyncio.get_running_loop().call_later(2.0, stop.set)
        await roles.trainer_main(config, worker_id="trainer", stop=stop, bus=MemoryBus(topic_specs(partitions=2)),
                                 state=MemoryStateStore())

    asyncio.run(lead())


@pytest.mark.slow
async def test_with_rank_uploads_rank_1_puts_its_own_chunks_of_the_first_version(tmp_path: Path) -> None:
    from rlbus.launch.roles import starting_model

    spawn_processes(rank_main, 2, str(tmp_path), timeout_s=120)

    store = LocalStore(tmp_path / "blobs")
    torch.manual_seed(0)
    model = starting_model(run_config(tmp_path), "test")  # what one process would start from: v1
    start = {n: t.to(torch.bfloat16) for n, t in weight_tensors(model).items()}
    sync = WeightSync(bus=MemoryBus(topic_specs()), store=store,
                      state={n: torch.zeros_like(t) for n, t in start.items()})
    await sync.rebuild(1)
    assert all(torch.equal(sync.state[n], t) for n, t in start.items())
    keyframe = await sync.load_manifest(1, "keyframe")
    mine = set(json.loads((tmp_path / "rank1.json").read_text()))
    chunks = {c.key for c in keyframe.chunks}
    assert mine and mine < chunks  # rank 1 put a part of v1's chunks, rank 0 the rest and the manifest
