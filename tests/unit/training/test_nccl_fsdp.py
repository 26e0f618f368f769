"""FSDP2 over NCCL on a GPU (skips without one; `make gpu-check` runs it): the sharded step, bf16 compute
over fp32 masters, computes what the plain step computes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.training.config import FSDPConfig, GRPOConfig, OptimConfig
from rlbus.training.ranks import Ranks, shard_model, world_size_for
from rlbus.training.spawn import free_port
from rlbus.training.step import build_optimizer, grpo_step
from rlbus_tools.bench.train import Size, synthetic_groups


def test_world_size_zero_is_one_rank_per_gpu() -> None:
    assert world_size_for(3) == 3
    assert world_size_for(0) == (max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")
def test_fsdp2_on_nccl_matches_the_unsharded_step() -> None:
    cfg = PolicyConfig(vocab=272, d_model=128, n_layer=2, n_head=4, max_seq=128, n_experts=0, d_ff=256)
    size = Size("toy", cfg, groups=2, group_size=4, prompt=16, completion=32, steps=1)
    groups = synthetic_groups(size, 0)
    config = GRPOConfig(normalize_std=False)  # compute_dtype auto: bf16 autocast on CUDA
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    plain = Policy(cfg).to(device)
    sharded = Policy(cfg).to(device)
    sharded.load_state_dict(plain.state_dict())
    expected = grpo_step(plain, build_optimizer(plain, OptimConfig(lr=1e-3)), groups, config=config, version=0)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        assert dist.get_backend(dist.group.WORLD) is not None
        ranks = Ranks(rank=0, world=1, device=device)
        shard_model(sharded, ranks, FSDPConfig())
        got = grpo_step(sharded, build_optimizer(sharded, OptimConfig(lr=1e-3)), groups, config=config, version=0,
                        ranks=ranks)  # fmt: skip
        assert got.tokens == expected.tokens
        assert abs(got.loss - expected.loss) < 1e-3 and abs(got.grad_norm - expected.grad_norm) < 1e-2 * (
            1 + expected.grad_norm)
    finally:
        dist.destroy_process_group()
