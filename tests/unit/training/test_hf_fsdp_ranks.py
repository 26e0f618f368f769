"""A Hugging Face model (`rlbus.models.hf.HFCausalLM`, a small random one from a ``transformers`` config) on
two gloo ranks (FSDP2, CPU, fp32) against the one-process trainer on the same batches, as
`test_fsdp_ranks.py` does for the in-repo policy: the same losses and the same weights bit for bit (the
gathered weights rank 0 publishes, the sharded publisher's digest), under the HF model's own names — the
one-process checkpoint's and publisher's, a tied embedding once — and checkpoints that move between world
sizes (one-process .pt → 2 ranks, DCP shards → 1 rank) without changing the curve.

Bit-identical for the reason `test_fsdp_ranks.py` gives (each rank's half of the rows is one process's
micro-batch, and a + b = b + a). A dense Llama-style model (GQA, tied embedding / LM head) and a Qwen3-MoE
(untied head) whose experts are fused into one [E, …] tensor per layer: every rank's step gives that tensor
a gradient (zero rows where nobody routed), as one process's does, so AdamW treats it alike.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from test_fsdp_ranks import GRPO, Recorder, batch, same

from rlbus.models.base import weight_tensors
from rlbus.training.checkpoint import load_checkpoint, model_from_state
from rlbus.training.config import FSDPConfig
from rlbus.training.ranks import Ranks
from rlbus.training.spawn import spawn_ranks
from rlbus.training.step import OptimConfig
from rlbus.training.trainer import Trainer

transformers = pytest.importorskip("transformers")

VOCAB = 64  # test_fsdp_ranks.batch draws token ids below 64
SHAPE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
STEPS = 6


def config(kind: str) -> Any:
    if kind == "llama":  # GQA (4 query heads, 2 KV heads), the LM head tied to the embedding
        return transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True)
    return transformers.Qwen3MoeConfig(**SHAPE, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                       decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def trainer(kind: str, directory: Path, *, seed: int, ranks: Ranks | None = None) -> Trainer:
    """A trainer of a fresh random HF model (``seed``: a restore must overwrite every weight); on ``ranks``
    it is sharded as the launch does (rank 0's weights shared, then FSDP2)."""
    from rlbus.models.hf import HFCausalLM

    model = HFCausalLM.from_config(config(kind), seed=seed)
    if ranks is not None:
        from rlbus.training.ranks import shard_model, share_weights

        share_weights(model, ranks)
        shard_model(model, ranks, FSDPConfig())
    return Trainer(model=model, optim=OptimConfig(lr=1e-2, weight_decay=0.1), grpo=GRPO, checkpoint_dir=directory,
                   publisher=Recorder(), ranks=ranks)  # type: ignore[arg-type]


async def steps(t: Trainer, first: int, last: int) -> list[float]:
    return [(await t.train_on(batch(k)))["loss"] for k in range(first, last + 1)]


def rank_main(ranks: Ranks, kind: str, directory: str, out: str) -> None:
    """One of two ranks: resume the one-process checkpoint of step 2, train 3–4, checkpoint (DCP), train 5–6;
    then every rank publishes the final weights through the sharded publisher (bf16, a keyframe)."""
    from rlbus.training.shard_publish import ShardOrder, ShardPublisher

    t = trainer(kind, Path(directory), seed=100 + ranks.rank, ranks=ranks)
    result: dict[str, Any] = {}
    if ranks.rank:
        t.follow()
    else:
        async def lead() -> None:
            await t.restore()
            losses = await steps(t, 3, 4)
            await t.save()
            losses += await steps(t, 5, STEPS)
            t.release()
            assert isinstance(t.publisher, Recorder)
            result.update(losses=losses, shipped=t.publisher.shipped, step=t.step)

        asyncio.run(lead())
    order = ShardOrder(model_id="m", version=1, base_version=0, keyframe_every=1, dtype=torch.bfloat16)
    published = ShardPublisher().publish(t.model, ranks, order)  # collective: every rank its part
    if published is not None:
        parts, digest = published
        result.update(digest=digest, published=sorted(m.name for p in parts for m in p.tensors))
        torch.save(result, out)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.slow
async def test_an_hf_model_trains_publishes_and_checkpoints_on_two_ranks_exactly_like_one(
    tmp_path: Path, kind: str
) -> None:
    from rlbus.weights.digest import state_digest

    one, two = tmp_path / "one", tmp_path / "two"
    ref = trainer(kind, one, seed=0)
    ref_losses = await steps(ref, 1, 2)
    await ref.save()  # a one-process checkpoint (HF names, the optimizer keyed by position)
    shutil.copytree(one, two)
    ref_losses += await steps(ref, 3, STEPS)
    assert isinstance(ref.publisher, Recorder)
    shipped = ref.publisher.shipped
    names = ref.model.state_dict().keys()
    if kind == "llama":  # tied: one parameter, published once under the embedding's name
        assert "lm_head.weight" in names and "lm_head.weight" not in shipped[STEPS]
        assert "model.embed_tokens.weight" in shipped[STEPS]

    out = tmp_path / "out.pt"
    await asyncio.to_thread(spawn_ranks, rank_main, 2, kind, str(two), str(out), timeout_s=240)
    got: dict[str, Any] = torch.load(out, weights_only=True)

    assert got["step"] == STEPS and got["losses"] == ref_losses[2:]
    for step in range(3, STEPS + 1):  # the weights gathered on rank 0, bit for bit and named alike
        assert same(got["shipped"][step], shipped[step]), step
    final = {n: t.to(torch.bfloat16) for n, t in weight_tensors(ref.model).items()}
    assert got["published"] == sorted(final) and got["digest"] == state_digest(final)  # the sharded publisher's

    saved = load_checkpoint(two)  # the N-rank .pt file: the full weights under the one-process names
    assert saved is not None and saved.step == 4 and saved.sharded == "step-000000004.dcp"
    assert saved.model.keys() == names
    rebuilt = model_from_state(saved)  # as `[model] checkpoint` and `rlbus generate` read it
    assert same(weight_tensors(rebuilt), shipped[4])
    if kind == "llama":
        hf = cast(Any, rebuilt).hf
        assert hf.lm_head.weight is hf.model.embed_tokens.weight  # still tied

    back = trainer(kind, two, seed=7)  # 2 → 1 rank: the DCP shards (weights and Adam moments) into one process
    assert await back.restore() is not None and back.step == 4
    assert await steps(back, 5, STEPS) == ref_losses[4:]
    assert same(weight_tensors(back.model), weight_tensors(ref.model))
