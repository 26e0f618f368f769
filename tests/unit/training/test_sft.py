"""Supervised warm start: the loss covers completion tokens only, training is seeded, main writes a
checkpoint the trainer can start from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import BOS_ID, EOS_ID
from rlbus.training.checkpoint import load_checkpoint, policy_from_state
from rlbus.training.sft import SFTExample, load_examples, main, pretrain

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def examples() -> list[SFTExample]:
    """ "d=" → the next digit: the prompts vary, the completion is what is learned."""
    return [SFTExample((BOS_ID, 48 + d, 61), (48 + (d + 1) % 10, EOS_ID)) for d in range(10)]


def model(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(CFG)


def test_first_loss_is_the_completion_cross_entropy() -> None:
    m = model()
    with torch.no_grad():
        nll, n = 0.0, 0
        for e in examples():
            ids = torch.tensor(e.prompt_ids + e.completion_ids)
            logp = torch.log_softmax(m(ids[None, :-1]).logits[0], -1)  # [T-1, V]
            P = len(e.prompt_ids)
            for t in range(P, len(ids)):  # completion tokens only
                nll -= float(logp[t - 1, ids[t]])
                n += 1
    losses = pretrain(m, examples(), steps=1, lr=1e-3, batch_size=10, seed=0)
    assert losses[0] == pytest.approx(nll / n, rel=1e-5)


def test_training_is_seeded_and_learns() -> None:
    a = pretrain(model(), examples(), steps=40, lr=1e-2, batch_size=5, seed=3)
    b = pretrain(model(), examples(), steps=40, lr=1e-2, batch_size=5, seed=3)
    c = pretrain(model(), examples(), steps=40, lr=1e-2, batch_size=5, seed=4)
    assert a == b and a != c
    assert sum(a[-5:]) / 5 < 0.5 * sum(a[:5]) / 5


def test_load_examples_text_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+1=", "completion": "2"})
        + "\n\n"
        + json.dumps({"prompt_ids": [257, 5], "completion_ids": [6, 258]})
        + "\n"
    )
    got = load_examples(path)
    assert got == [SFTExample((BOS_ID, *b"1+1="), (50, EOS_ID)), SFTExample((257, 5), (6, 258))]
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:1"):
        load_examples(path)


def test_main_writes_a_checkpoint_the_trainer_can_start_from(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}=", "completion": str((d + 1) % 10)}) + "\n" for d in range(10)))
    lines: list[str] = []
    losses = main(data, tmp_path / "out", model="tiny", steps=3, lr=1e-3, batch_size=4, seed=0, log=lines.append)
    assert len(losses) == 3 and any("wrote" in line for line in lines)
    state = load_checkpoint(tmp_path / "out")
    assert state is not None and (state.step, state.version, state.optimizer) == (0, 0, None)
    restored = policy_from_state(state)
    assert restored.config == PolicyConfig.tiny()
    # --init continues from those weights (zero steps: the copy is exact, whatever the seed).
    assert main(data, tmp_path / "out2", init=tmp_path / "out", steps=0, seed=1, log=lines.append) == []
    copied = load_checkpoint(tmp_path / "out2")
    assert copied is not None and all(torch.equal(copied.model[k], v) for k, v in state.model.items())
