"""The trainer worker: publish cadence through a real WeightPublisher, staleness against the published
version, publisher continuity after a restart, a Hugging Face model end to end (tied embedding published
once, described in its checkpoint), and a free event loop while a step runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rlbus.blobs.local import LocalStore
from rlbus.bus import MemoryBus
from rlbus.bus.topics import WEIGHTS, topic_specs
from rlbus.models.base import weight_tensors
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import WeightVersion
from rlbus.training.batch import Group, Sample
from rlbus.training.checkpoint import load_checkpoint
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer
from rlbus.weights.digest import state_digest
from rlbus.weights.publish import WeightPublisher

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    instance = MemoryBus(topic_specs())
    await instance.start()
    yield instance
    await instance.close()


def groups(version: int, seed: int = 0, *, rows: int = 4, length: int = 12, routed: bool = True) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        samples = []
        for _ in range(rows):
            mask = torch.arange(length) >= 3
            samples.append(
                Sample(
                    token_ids=torch.randint(0, 256, (length,), generator=g),
                    loss_mask=mask,
                    logprobs=torch.where(mask, -5.5, 0.0),
                    versions=torch.where(mask, version, -1),
                    routed_experts=torch.rand(CFG.n_layer, length, CFG.n_experts, generator=g).argsort(-1)[..., :2]
                    if routed
                    else None,
                )
            )
        out.append(Group(samples=tuple(samples), rewards=torch.arange(rows, dtype=torch.float32)))
    return out


def new_trainer(
    publisher: WeightPublisher | None,
    directory: Path | None = None,
    *,
    publish_every: int = 1,
    checkpoint_every: int = 0,
) -> Trainer:
    torch.manual_seed(0)
    return Trainer(
        model=Policy(CFG),
        optim=OptimConfig(lr=1e-2),
        grpo=GRPOConfig(max_staleness=1),
        publisher=publisher,
        checkpoint_dir=directory,
        publish_every=publish_every,
        checkpoint_every=checkpoint_every,
    )


async def test_publishes_every_k_steps(bus: MemoryBus, tmp_path: Path) -> None:
    publisher = WeightPublisher(bus=bus, store=LocalStore(tmp_path / "blobs"), keyframe_every=100)
    trainer = new_trainer(publisher, publish_every=2)
    published = []
    for i in range(5):
        metrics = await trainer.train_on(groups(trainer.version, seed=i))
        published.append(metrics["published"])
        assert metrics["step"] == i + 1 and metrics["tokens"] == 2 * 4 * 9
    assert published == [False, True, False, True, False]
    assert trainer.version == publisher.version == 2
    assert [s.kind for s in publisher.history] == ["keyframe", "delta"]
    assert await trainer.publish() == 3  # on demand, off the cadence: the weights after step 5
    announced: list[WeightVersion] = []
    async with bus.consumer([WEIGHTS]) as consumer:
        while len(announced) < 3:
            announced += [r.value for r in await consumer.getmany(timeout_s=1.0)]
    assert [(m.version, m.trainer_step) for m in announced] == [(1, 2), (2, 4), (3, 5)]
    # What engines become bit-identical to: the bf16 cast of the trainer's current master weights.
    assert announced[-1].model_digest == state_digest(publisher.snapshot(trainer.model.state_dict()))
    assert announced[-2].model_digest != announced[-1].model_digest


async def test_staleness_is_measured_against_the_published_version() -> None:
    trainer = new_trainer(None, publish_every=1)
    for i in range(3):
        await trainer.train_on(groups(trainer.version, seed=i))
    assert trainer.version == 3
    metrics = await trainer.train_on(groups(1, seed=9))  # 2 versions behind, max_staleness = 1
    assert metrics["stale_dropped"] == 8 and metrics["staleness"] == {2: 8}
    assert metrics["step"] == 3 and not metrics["published"]  # nothing trained: not a step
    with pytest.raises(ValueError, match="newer than the trainer"):
        await trainer.train_on(groups(4))


async def test_restart_continues_the_version_sequence(bus: MemoryBus, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "blobs")
    trainer = new_trainer(WeightPublisher(bus=bus, store=store), tmp_path / "ckpt", publish_every=1, checkpoint_every=2)
    for i in range(2):
        metrics = await trainer.train_on(groups(trainer.version, seed=i), offsets={"rl.rollouts.v1:0": 7 + i})
    assert metrics["checkpointed"] and (tmp_path / "ckpt" / "latest").exists()

    fresh = WeightPublisher(bus=bus, store=store)  # a restarted process: the publisher starts at 0
    restarted = new_trainer(fresh, tmp_path / "ckpt", publish_every=1)
    assert await restarted.restore() == {"rl.rollouts.v1:0": 8}
    # The trainer owns the numbering; the fresh publisher has published nothing yet and is not told.
    assert (restarted.step, restarted.version, fresh.version) == (2, 2, 0)
    await restarted.train_on(groups(restarted.version, seed=5))
    assert fresh.history[-1].version == 3 and fresh.history[-1].kind == "keyframe"  # no base yet: a keyframe


async def test_an_hf_model_trains_publishes_its_tied_embedding_once_and_checkpoints_its_description(
    bus: MemoryBus, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from rlbus.models.hf import HFCausalLM

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    model = HFCausalLM.from_config(config, seed=0)
    publisher = WeightPublisher(bus=bus, store=LocalStore(tmp_path / "blobs"))
    trainer = Trainer(model=model, optim=OptimConfig(lr=1e-2), grpo=GRPOConfig(gradient_checkpointing=True),
                      publisher=publisher, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1)
    assert model.hf.is_activation_checkpointing
    metrics = await trainer.train_on(groups(0, routed=False))
    assert metrics["published"] and metrics["checkpointed"] and metrics["router_flip_rate"] is None
    async with bus.consumer([WEIGHTS]) as consumer:
        [announced] = [r.value for r in await consumer.getmany(timeout_s=1.0)]
    names = {t.name for t in announced.tensors}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # one tensor, sent once
    assert names == set(weight_tensors(model)) and len(names) == len(list(model.parameters()))
    assert announced.model_digest == state_digest(publisher.snapshot(weight_tensors(model)))
    state = load_checkpoint(tmp_path / "ckpt")
    assert state is not None and state.model_description == model.describe()


async def test_the_event_loop_stays_free_during_a_step() -> None:
    trainer = new_trainer(None)
    big = groups(0, rows=16, length=48)
    await trainer.train_on(groups(0))  # warm-up (first-call imports)
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    metrics = await trainer.train_on(big)
    during = ticks - start
    done.set()
    await task
    assert metrics["step_s"] > 0.01 and during >= 3  # a step run on the loop itself would allow 0 ticks
