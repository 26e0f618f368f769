"""The trainer on two ranks with activation checkpointing, and with bf16 compute (`[trainer.fsdp]`).

Activation checkpointing recomputes each block's forward in the backward pass; on CPU the recomputation is
deterministic, so two ranks still train bit for bit what one process trains. bf16 compute
(``param_dtype = "bfloat16"``: FSDP all-gathers the parameters in bf16 and the forward and backward run in
bf16, over fp32 master weights and fp32 Adam) rounds every matmul input to 8 bits of mantissa, so it agrees
with the fp32 one-process step only to bf16's precision: the stated tolerance below is that, and the test
also checks it is not accidentally fp32 (the results must differ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_fsdp_ranks import CFG, batch

from rlbus.models.base import weight_tensors
from rlbus.models.policy import Policy
from rlbus.training.config import FSDPConfig
from rlbus.training.ranks import Ranks, full_weights, shard_model
from rlbus.training.spawn import spawn_ranks
from rlbus.training.step import GRPOConfig, OptimConfig, build_optimizer, grpo_step

CHECKPOINTED = GRPOConfig(max_grad_norm=0.0, micro_batch_rows=3, gradient_checkpointing=True)
PLAIN = GRPOConfig(max_grad_norm=0.0, micro_batch_rows=3)


def train(ranks: Ranks | None, config: GRPOConfig, fsdp: FSDPConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three GRPO steps on the tests' 6-row batches: the losses and the (full) weights after."""
    torch.manual_seed(0)
    model = Policy(CFG)
    model.set_gradient_checkpointing(config.gradient_checkpointing)
    if ranks is not None:
        shard_model(model, ranks, fsdp)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    losses = [grpo_step(model, optimizer, batch(k), config=config, version=k - 1, ranks=ranks).loss for k in (1, 2, 3)]
    return losses, full_weights(model) if ranks is not None else weight_tensors(model)


def rank_main(ranks: Ranks, out: str, checkpointing: bool, param_dtype: str) -> None:
    config = CHECKPOINTED if checkpointing else PLAIN
    losses, weights = train(ranks, config, FSDPConfig(param_dtype=param_dtype))  # type: ignore[arg-type]
    if ranks.rank == 0:
        torch.save({"losses": losses, "weights": weights}, out)


def on_two_ranks(tmp_path: Path, *, checkpointing: bool, param_dtype: str) -> dict[str, Any]:
    out = tmp_path / "out.pt"
    spawn_ranks(rank_main, 2, str(out), checkpointing, param_dtype, timeout_s=180)
    got: dict[str, Any] = torch.load(out, weights_only=True)
    return got


@pytest.mark.slow
def test_activation_checkpointing_on_two_ranks_trains_exactly_like_one_process(tmp_path: Path) -> None:
    want_losses, want = train(None, CHECKPOINTED, FSDPConfig())
    plain_losses, _ = train(None, PLAIN, FSDPConfig())
    assert want_losses == plain_losses  # recomputing the forward changes nothing on CPU
    got = on_two_ranks(tmp_path, checkpointing=True, param_dtype="float32")
    assert got["losses"] == want_losses
    assert got["weights"].keys() == want.keys() and all(torch.equal(got["weights"][k], want[k]) for k in want)


@pytest.mark.slow
def test_bf16_compute_on_two_ranks_agrees_with_fp32_to_bf16_precision(tmp_path: Path) -> None:
    want_losses, want = train(None, PLAIN, FSDPConfig())
    got = on_two_ranks(tmp_path, checkpointing=False, param_dtype="bfloat16")
    assert got["losses"] != want_losses, "bf16 compute gave fp32's exact losses: the policy was not applied"
    for a, b in zip(got["losses"], want_losses, strict=True):
        assert abs(a - b) <= 2e-2 * max(1.0, abs(b)), (got["losses"], want_losses)
    for name, tensor in want.items():
        assert got["weights"][name].dtype == torch.float32  # the master weights stay fp32
        # three AdamW steps of lr 1e-2 move a weight by ≤ 3e-2; bf16 gradients may flip an update's sign
        # where the fp32 gradient is near 0, so a weight can differ by up to two steps' worth
        assert torch.allclose(got["weights"][name], tensor, atol=6e-2, rtol=0), name
