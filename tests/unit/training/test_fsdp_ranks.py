"""The trainer on two gloo ranks (FSDP2, CPU, fp32) against the one-process trainer on the same batches:
the same losses and the same weights bit for bit, published weights gathered on rank 0 included, and
checkpoints that move between world sizes (1 → 2 → 1) without changing the curve.

Why bit-identical and not "close": each rank trains its half of the batch and FSDP sums the two halves'
gradients, which is what one process computes with ``micro_batch_rows`` = half the rows (a + b = b + a in
floating point). Clipping is off (``max_grad_norm = 0``): the sharded gradient norm is summed in another
order, so an active clip would agree only to float rounding (`rlbus.training.step`, "On N ranks").
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.models.base import weight_tensors
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.training.batch import Group, Sample
from rlbus.training.checkpoint import load_checkpoint, model_from_state
from rlbus.training.config import FSDPConfig
from rlbus.training.ranks import Ranks
from rlbus.training.spawn import spawn_ranks
from rlbus.training.step import GRPOConfig, OptimConfig, _plan
from rlbus.training.trainer import Trainer

CFG = PolicyConfig(vocab=64, d_model=32, n_layer=2, n_head=2, max_seq=32, d_ff=32, n_experts=0)  # dense: see ranks.py
GRPO = GRPOConfig(max_grad_norm=0.0, micro_batch_rows=3)  # 6 rows a step: what each of two ranks trains
STEPS = 6


def batch(step: int, sizes: tuple[int, ...] = (3, 3)) -> list[Group]:
    """Step ``step``'s groups (default 2 of 3 samples: 6 rows) sampled by the version before it, v(step − 1)."""
    g = torch.Generator().manual_seed(step)
    groups = []
    for size in sizes:
        samples = []
        for _ in range(size):
            T = int(torch.randint(4, 9, (), generator=g))
            mask = torch.arange(T) >= 2
            samples.append(Sample(
                token_ids=torch.randint(0, CFG.vocab, (T,), generator=g), loss_mask=mask,
                logprobs=torch.where(mask, -4.0 + torch.rand(T, generator=g), 0.0),
                versions=torch.where(mask, step - 1, -1),
            ))
        groups.append(Group(samples=tuple(samples), rewards=torch.rand(size, generator=g)))
    return groups


class Recorder:
    """Stands in for the weight publisher: keeps what each version would ship."""

    def __init__(self) -> None:
        self.version = 0
        self.shipped: dict[int, dict[str, torch.Tensor]] = {}

    async def publish(self, weights: dict[str, torch.Tensor], *, version: int, step: int) -> Any:
        self.shipped[step] = {k: v.detach().clone() for k, v in weights.items()}
        self.version = version
        return self


def trainer(directory: Path, *, seed: int, ranks: Ranks | None = None) -> Trainer:
    """A trainer of a fresh policy (``seed``: a restore must overwrite every weight)."""
    torch.manual_seed(seed)
    model = Policy(CFG)
    if ranks is not None:
        from rlbus.training.ranks import shard_model

        shard_model(model, ranks, FSDPConfig())
    return Trainer(model=model, optim=OptimConfig(lr=1e-2, weight_decay=0.1), grpo=GRPO, checkpoint_dir=directory,
                   publisher=Recorder(), ranks=ranks)  # type: ignore[arg-type]


async def steps(t: Trainer, first: int, last: int) -> list[float]:
    return [(await t.train_on(batch(k)))["loss"] for k in range(first, last + 1)]


def rank_main(ranks: Ranks, directory: str, out: str) -> None:
    """One of two ranks: resume the one-process checkpoint of step 2, train 3–4, checkpoint (DCP), train 5–6."""
    t = trainer(Path(directory), seed=100 + ranks.rank, ranks=ranks)
    if ranks.rank:
        t.follow()
        return

    async def lead() -> None:
        await t.restore()
        losses = await steps(t, 3, 4)
        metadata = (await t.save()).with_suffix(".dcp") / ".metadata"
        written = metadata.stat().st_mtime_ns
        await t.save()  # a second checkpoint of the same step (a stop right after one) keeps its shards
        assert metadata.stat().st_mtime_ns == written
        losses += await steps(t, 5, 6)
        t.release()
        assert isinstance(t.publisher, Recorder)
        torch.save({"losses": losses, "shipped": t.publisher.shipped, "step": t.step}, out)

    asyncio.run(lead())


UNEVEN = GRPOConfig(minibatches=2, micro_batch_rows=1, max_grad_norm=0.5)  # 5 rows: slices of 2 and 1 per minibatch


def uneven_steps(ranks: Ranks | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps of two minibatches on 5 rows, one row per pass, the clip active: the losses and the weights."""
    from rlbus.training.ranks import full_weights, shard_model
    from rlbus.training.step import build_optimizer, grpo_step

    torch.manual_seed(0)
    model = Policy(CFG)
    if ranks is not None:
        shard_model(model, ranks, FSDPConfig())
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    losses = [grpo_step(model, optimizer, batch(k, (3, 2)), config=UNEVEN, version=k - 1, ranks=ranks).loss
              for k in (1, 2)]
    return losses, full_weights(model) if ranks is not None else weight_tensors(model)


def uneven_rank_main(ranks: Ranks, out: str) -> None:
    losses, weights = uneven_steps(ranks)
    if ranks.rank == 0:
        torch.save({"losses": losses, "weights": weights}, out)


def two_ranks(directory: Path | None, out: Path) -> dict[str, Any]:
    """Run `rank_main` (with a checkpoint ``directory``) or `uneven_rank_main` on two spawned gloo ranks
    (`rlbus.training.spawn`); rank 0's results."""
    if directory is not None:
        spawn_ranks(rank_main, 2, str(directory), str(out), timeout_s=120)
    else:
        spawn_ranks(uneven_rank_main, 2, str(out), timeout_s=120)
    result: dict[str, Any] = torch.load(out, weights_only=True)
    return result


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_two_ranks_train_publish_and_checkpoint_exactly_like_one(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    ref = trainer(one, seed=0)
    ref_losses = await steps(ref, 1, 2)
    await ref.save()  # a one-process checkpoint (full optimizer state keyed by position)
    shutil.copytree(one, two)
    ref_losses += await steps(ref, 3, STEPS)
    assert isinstance(ref.publisher, Recorder)
    shipped = ref.publisher.shipped

    got = await asyncio.to_thread(two_ranks, two, tmp_path / "out.pt")  # 1 → 2 ranks at step 2

    assert got["step"] == STEPS and got["losses"] == ref_losses[2:]
    for step in range(3, STEPS + 1):  # what rank 0 publishes: the gathered weights, bit for bit
        assert same(got["shipped"][step], shipped[step]), step
    assert sorted(os.listdir(two)) == ["latest", "step-000000002.pt", "step-000000004.dcp", "step-000000004.pt"]

    saved = load_checkpoint(two)  # the N-rank checkpoint's file holds the full weights, as `rlbus generate` reads
    assert saved is not None and saved.step == 4 and saved.sharded == "step-000000004.dcp"
    assert same(weight_tensors(model_from_state(saved)), shipped[4])

    back = trainer(two, seed=7)  # 2 → 1 rank: the DCP shards (weights and Adam moments) into one process
    assert await back.restore() is not None and back.step == 4
    assert await steps(back, 5, STEPS) == ref_losses[4:]
    assert same(weight_tensors(back.model), weight_tensors(ref.model))


def test_uneven_slices_several_minibatches_and_an_active_clip_agree_to_float_rounding(tmp_path: Path) -> None:
    """Rank 1 has fewer rows (zero-weighted passes), the proximal forward runs per rank, the clip divides
    by a norm summed over shards: the same update up to the summation order of floats."""
    want_losses, want = uneven_steps(None)
    got = two_ranks(None, tmp_path / "out.pt")
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
    for name, tensor in want.items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("rows", "size", "world", "want"), [
    (6, 0, 2, [[(0, 3)], [(3, 6)]]),
    (6, 2, 2, [[(0, 2), (2, 3)], [(3, 5), (5, 6)]]),
    (5, 2, 2, [[(0, 2), (2, 3)], [(3, 5), None]]),  # rank 1 has one chunk fewer: a zero-weighted pass
    (1, 0, 3, [[(0, 1)], [None], [None]]),  # more ranks than rows
])
def test_each_rank_runs_its_slice_and_as_many_passes_as_the_others(
    rows: int, size: int, world: int, want: list[list[tuple[int, int] | None]]
) -> None:
    assert [_plan(0, rows, size, Ranks(rank=r, world=world)) for r in range(world)] == want


def test_one_rank_joins_no_process_group_and_a_launch_must_match_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from rlbus.training.ranks import join_ranks

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert join_ranks(1) is None and not dist.is_initialized()
    with pytest.raises(ValueError, match="torchrun --nproc-per-node"):
        join_ranks(2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="launched on 4"):
        join_ranks(2)
