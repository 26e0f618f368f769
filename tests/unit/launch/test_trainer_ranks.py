"""`rlbus worker trainer` on two ranks, as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
environment, ``[trainer] world_size = 2``): rank 0 runs the trainer on the in-memory bus, publishes the
first version (weights gathered from both ranks) and checkpoints when it stops; rank 1 follows it with
its bus, state store and blob store forbidden — it never opens any of them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.launch.config import RunConfig, config_from_dict
from rlbus.models.base import weight_tensors
from rlbus.training.spawn import spawn_processes

SHAPE = {"vocab": 64, "d_model": 32, "n_layer": 2, "n_head": 2, "max_seq": 32, "d_ff": 32, "n_experts": 0}


#: A run's DPO stage (pairs from the task): on two ranks it trains sharded, on every rank (`sharded_dpo`).
DPO = {"task_pairs": 12, "train": {"steps": 3, "batch_size": 5, "lr": 1e-3}}


def run_config(tmp: Path, *, dpo: bool = False) -> RunConfig:
    return config_from_dict({
        "state": {"url": "memory://"}, "store": {"dir": str(tmp / "blobs")},
        "model": {**SHAPE, "vocab": 272} if dpo else SHAPE,  # DPO's task pairs are byte-tokenized
        "trainer": {"world_size": 2, "warm_steps": 0, "checkpoint_dir": str(tmp / "ckpt")},
        **({"dpo": DPO} if dpo else {}),
    }, {})


def forbidden(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a follower rank touched the bus, the state store or the blob store")


def rank_main(rank: int, port: int, tmp: str, dpo: bool = False) -> None:
    import rlbus.launch.roles as roles

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    config = run_config(Path(tmp), dpo=dpo)
    stop = asyncio.Event()
    if rank:
        for name in ("connected", "bus_for", "state_for", "store_for"):
            setattr(roles, name, forbidden)
        asyncio.run(roles.trainer_main(config, worker_id="trainer", stop=stop))
        return

    async def lead() -> None:
        from rlbus.bus.memory import MemoryBus
        from rlbus.bus.topics import topic_specs
        from rlbus.state.memory import MemoryStateStore

        asyncio.get_running_loop().call_later(2.0, stop.set)
        await roles.trainer_main(config, worker_id="trainer", stop=stop, bus=MemoryBus(topic_specs(partitions=2)),
                                 state=MemoryStateStore())

    asyncio.run(lead())


def two_ranks(tmp_path: Path, *, dpo: bool = False) -> None:
    spawn_processes(rank_main, 2, str(tmp_path), dpo, timeout_s=120)


@pytest.mark.slow
def test_rank_0_alone_is_on_the_bus_and_the_ranks_checkpoint_together(tmp_path: Path) -> None:
    from rlbus.launch.roles import starting_model
    from rlbus.training.checkpoint import load_checkpoint

    two_ranks(tmp_path)
    saved = load_checkpoint(tmp_path / "ckpt")  # written on stop: shards from both ranks, the gathered weights
    assert saved is not None and saved.version == 1 and saved.sharded == "step-000000000.dcp"
    assert (tmp_path / "ckpt" / saved.sharded / ".metadata").is_file()
    torch.manual_seed(0)
    start = weight_tensors(starting_model(run_config(tmp_path), "test"))  # what one process would start from
    assert all(torch.equal(saved.model[k], v) for k, v in start.items())
    assert any((tmp_path / "blobs").rglob("*"))  # v1 went to the blob store


@pytest.mark.slow
def test_the_dpo_stage_trains_sharded_on_every_rank_like_one_process(tmp_path: Path) -> None:
    """The run's DPO stage under ``world_size = 2``: both ranks train it sharded before RL, and the weights
    RL starts from (the first checkpoint) are one process's DPO-trained weights to float rounding
    (tests/unit/training/test_dpo_ranks.py says why not bit for bit)."""
    from rlbus.launch.roles import starting_model
    from rlbus.training.checkpoint import load_checkpoint

    two_ranks(tmp_path, dpo=True)
    saved = load_checkpoint(tmp_path / "ckpt")
    assert saved is not None
    config = run_config(tmp_path, dpo=True)
    torch.manual_seed(0)
    want = weight_tensors(starting_model(config, "test"))  # DPO in one process
    torch.manual_seed(0)
    before = weight_tensors(starting_model(config, "test", with_dpo=False))
    assert all(want[k].shape == before[k].shape for k in want)
    assert max(float((want[k] - before[k]).abs().max()) for k in want) > 1e-3  # the stage trained
    for name, tensor in want.items():
        torch.testing.assert_close(saved.model[name], tensor, rtol=0, atol=1e-5, msg=name)
