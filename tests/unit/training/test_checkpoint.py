"""Checkpoints: atomic writes, retention, rebuilding the model they describe (in-repo policy, Hugging Face,
older checkpoints), and a restart that continues bit-identically."""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.training import checkpoint as ckpt
from rlbus.training.batch import Group, Sample
from rlbus.training.checkpoint import (
    TrainerState,
    load_checkpoint,
    model_from_state,
    policy_from_state,
    save_checkpoint,
)
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def state(step: int) -> TrainerState:
    torch.manual_seed(step)
    model = Policy(CFG)
    return TrainerState(
        step=step,
        version=step // 2,
        model=model.state_dict(),
        offsets={"rl.rollouts.v1:0": 10 * step},
        rng=ckpt.capture_rng(),
        model_description=model.describe(),
    )


def test_round_trip_and_retention(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        path = save_checkpoint(tmp_path, state(step), keep=2)
    assert path.name == "step-000000003.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000002.pt", "step-000000003.pt"]
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None
    assert (loaded.step, loaded.version, loaded.offsets) == (3, 1, {"rl.rollouts.v1:0": 30})
    model = model_from_state(loaded)
    assert isinstance(model, Policy) and model.config == CFG
    want = state(3).model
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    assert load_checkpoint(tmp_path / "step-000000002.pt").step == 2  # type: ignore[union-attr]
    (tmp_path / "empty").mkdir()
    assert load_checkpoint(tmp_path / "empty") is None


def test_a_checkpoint_from_before_model_descriptions_still_loads(tmp_path: Path) -> None:
    new = state(1)
    payload = {"step": 1, "version": 0, "model": new.model, "optimizer": None, "rng": {}, "offsets": {},
               "policy_config": dataclasses.asdict(CFG)}  # the old layout: no model_description, no rollouts_trained
    torch.save(payload, tmp_path / "old.pt")
    loaded = load_checkpoint(tmp_path / "old.pt")
    assert loaded is not None and loaded.model_description == {"kind": "policy", "shape": dataclasses.asdict(CFG)}
    model = policy_from_state(loaded)  # the Policy-typed shim build.py / roles.py still use
    assert model.config == CFG and all(torch.equal(model.state_dict()[k], v) for k, v in new.model.items())


def test_hf_model_round_trip_keeps_weights_and_the_tied_embedding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    from rlbus.models.hf import HFCausalLM

    def model_from_description(desc: Mapping[str, Any], *, dtype: torch.dtype = torch.float32,
                               device: str = "cpu") -> HFCausalLM:
        """The builder `rlbus.models.sources` provides, for the one kind this test writes (a config)."""
        config = transformers.AutoConfig.for_model(**desc["config"])
        return HFCausalLM.from_config(config, seed=123, dtype=dtype)

    sources = types.ModuleType("rlbus.models.sources")
    sources.model_from_description = model_from_description  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rlbus.models.sources", sources)

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    model = HFCausalLM.from_config(config, seed=0)
    save_checkpoint(tmp_path, TrainerState(step=1, version=1, model=model.state_dict(),
                                           model_description=model.describe()))
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded.model_description == model.describe()
    restored = model_from_state(loaded)
    assert isinstance(restored, HFCausalLM)
    want = model.state_dict()
    assert restored.state_dict().keys() == want.keys()
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in want.items())  # not the seed-123 init
    assert restored.hf.lm_head.weight is restored.hf.model.embed_tokens.weight
    with pytest.raises(ValueError, match="not an in-repo policy"):
        policy_from_state(loaded)


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, state(1))

    def torn_write(obj: Any, f: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", torn_write)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, state(2))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000001.pt"]  # no temp file left
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 1


def test_rng_round_trip() -> None:
    torch.manual_seed(7)
    random.seed(7)
    saved = ckpt.capture_rng()
    want = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    ckpt.restore_rng(saved)
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


# ---------------------------------------------------------------------------------------------------------
# restart → bit-identical continuation


def groups_from_global_rng(version: int) -> list[Group]:
    """Data drawn from the *global* torch RNG, like an engine sharing the process: a resume that forgot the
    RNG state would train on different data."""
    groups = []
    for _ in range(2):
        samples = []
        for _ in range(3):
            T = int(torch.randint(4, 9, ()))
            mask = torch.arange(T) >= 2
            samples.append(
                Sample(
                    token_ids=torch.randint(0, 256, (T,)),
                    loss_mask=mask,
                    logprobs=torch.where(mask, -5.0 + torch.rand(T), 0.0),
                    versions=torch.where(mask, version, -1),
                    routed_experts=torch.rand(CFG.n_layer, T, CFG.n_experts).argsort(-1)[..., :2],
                )
            )
        groups.append(Group(samples=tuple(samples), rewards=torch.rand(3)))
    return groups


def trainer(directory: Path, seed: int) -> Trainer:
    torch.manual_seed(seed)
    return Trainer(
        model=Policy(CFG),
        optim=OptimConfig(lr=1e-2, weight_decay=0.1),
        grpo=GRPOConfig(max_staleness=2),
        checkpoint_dir=directory,
        publish_every=1,
        checkpoint_every=2,
    )


async def train(t: Trainer, steps: int) -> None:
    for _ in range(steps):
        await t.train_on(groups_from_global_rng(t.version), offsets={"rl.rollouts.v1:0": 100 + t.step})


async def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = trainer(tmp_path / "a", seed=0)
    torch.manual_seed(123)
    await train(straight, 4)

    torch.manual_seed(123)
    first = trainer(tmp_path / "b", seed=0)
    torch.manual_seed(123)
    await train(first, 2)  # checkpoint_every=2: saved after step 2
    await train(first, 1)  # progress after the checkpoint is lost in the "crash"
    del first

    torch.manual_seed(999)  # a new process: other init, other RNG state
    resumed = trainer(tmp_path / "b", seed=5)
    offsets = await resumed.restore()
    assert offsets == {"rl.rollouts.v1:0": 101}
    assert (resumed.step, resumed.version) == (2, 2)
    await train(resumed, 2)

    assert (resumed.step, resumed.version, resumed.offsets) == (straight.step, straight.version, straight.offsets)
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for p_want, p_got in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        a, b = straight.optimizer.state[p_want], resumed.optimizer.state[p_got]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
