"""The DPO stage on two gloo ranks (FSDP2, CPU, fp32) against one process on the same pairs: the same
losses and metrics, and the same weights after K steps, to float rounding.

Why a tolerance and not bit for bit (as the GRPO step on two ranks is, test_fsdp_ranks.py): one process
scores the whole batch in one packed forward padded to its longest side and takes the mean of the pair
losses; on two ranks each rank packs only its own slice (padded to *its* longest side, so the matmuls
have other shapes) and the mean is the sum of two weighted halves. Both change the float rounding of
the gradient, and AdamW's normalisation lets that reach the weights at the scale of the rounding, far
below one learning-rate step (lr 1e-2 here). The batch (5 pairs) splits 3 + 2 and the clip is active,
so the uneven slice and the sharded gradient norm are covered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.models.base import weight_tensors
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.training.config import DPOConfig, FSDPConfig
from rlbus.training.dpo import train_dpo
from rlbus.training.preference import PreferencePair
from rlbus.training.ranks import Ranks, full_weights, shard_model
from rlbus.training.sft import SFTExample
from rlbus.training.spawn import spawn_ranks

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=0, d_ff=32)  # dense: ranks.py
DPO = DPOConfig(steps=4, batch_size=5, lr=1e-2, beta=0.5, max_grad_norm=0.05)
TOK = ByteTokenizer()


def pairs() -> list[PreferencePair]:
    """Twelve pairs of different lengths (so each rank's slice pads differently)."""
    out = []
    for i in range(12):
        context = TOK.encode(f"q{i:02d}?" + " more" * (i % 3), bos=True)
        out.append(PreferencePair(
            chosen=SFTExample.from_completion(context, TOK.encode("yes" + "!" * (i % 4), eos=True)),
            rejected=SFTExample.from_completion(context, TOK.encode("no", eos=True)),
        ))
    return out


def dpo_run(ranks: Ranks | None) -> dict[str, Any]:
    """K DPO steps from the seeded model: every step's metrics and the final weights (rank 0's, gathered)."""
    torch.manual_seed(0)
    model = Policy(CFG)
    if ranks is not None:
        shard_model(model, ranks, FSDPConfig())
    result = train_dpo(model, pairs(), DPO, ranks=ranks)
    weights = full_weights(model) if ranks is not None else weight_tensors(model)
    return {"steps": [vars(s) for s in result.steps], "weights": weights}


def dpo_rank(ranks: Ranks, out: str) -> None:
    got = dpo_run(ranks)
    if ranks.rank == 0:
        torch.save(got, out)


@pytest.mark.slow
def test_dpo_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    want = dpo_run(None)
    spawn_ranks(dpo_rank, 2, str(tmp_path / "out.pt"), timeout_s=180)
    got = torch.load(tmp_path / "out.pt", weights_only=False)

    assert len(got["steps"]) == len(want["steps"]) == DPO.steps
    for mine, ref in zip(got["steps"], want["steps"], strict=True):
        for key in ("loss", "chosen_reward", "rejected_reward", "margin", "grad_norm"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (mine["step"], key)
        assert mine["accuracy"] == ref["accuracy"]
    assert want["steps"][-1]["loss"] < want["steps"][0]["loss"]  # it trained: the comparison is not vacuous
    assert any(s["grad_norm"] > DPO.max_grad_norm for s in want["steps"])  # and the clip was active
    assert got["weights"].keys() == want["weights"].keys()
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)
