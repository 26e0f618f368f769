"""The mismatch and train benchmarks at toy sizes: their figures are well-formed and replay's guarantees hold."""

from __future__ import annotations

import pytest

from rlbus.bench import mismatch, train
from rlbus.models.policy import PolicyConfig


def test_mismatch_cases_and_replay_guarantee() -> None:
    setup = mismatch.Setup(d_model=32, train_steps=3, prompts=5, new_tokens=6, engine_batch=2, trainer_batch=3)
    cases = mismatch.measure(mismatch.train(setup), setup)
    assert [c["name"] for c in cases] == [
        "bf16", "bf16 + replay", "amp", "amp + replay", "fp32", "fp32 + replay",
    ]  # fmt: skip
    for c in cases:
        assert c["tokens"] == 5 * 6 and c["kl"] >= 0 and c["max_abs_dlogprob"] >= 0
        if c["replay"]:
            assert c["router_flip_rate"] == 0.0  # the experts used are exactly the engine's, token by token
        else:
            assert c["router_flip_rate"] == c["router_own_flip_rate"]
    fp32 = {c["replay"]: c for c in cases if c["trainer"] == "fp32"}
    assert fp32[False]["max_abs_dlogprob"] > 0  # an fp32 trainer never matches a bf16 engine exactly
    summary = mismatch.summarize(cases)
    assert summary["replay_kl_reduction"] == min(summary["replay_kl_reduction_by_trainer"].values())
    assert summary["replay_flip_rate_max"] == 0.0


def test_train_bench_measures_both_modes() -> None:
    cfg = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)
    size = train.Size("toy", cfg, groups=2, group_size=2, prompt=4, completion=6, steps=2)
    rows = [train.measure(size, replay=r) for r in (False, True)]
    for row in rows:
        assert row["steps"] == 2 and row["steps_per_s"] > 0
        assert row["trained_tokens_per_s"] == pytest.approx(row["steps_per_s"] * 4 * 6)
        assert row["tokens_per_s"] == pytest.approx(row["steps_per_s"] * 4 * 9)


def test_mismatch_on_a_random_hf_moe_replays_with_zero_flips() -> None:
    pytest.importorskip("transformers", reason="the hf-moe mode needs the 'transformers' package")
    setup = mismatch.Setup(d_model=32, train_steps=0, prompts=5, new_tokens=6, engine_batch=2, trainer_batch=3)
    cases = mismatch.measure_hf(mismatch.random_hf_moe(setup), setup)
    assert [c["name"] for c in cases] == ["fp32", "fp32 + replay"]
    plain, replayed = cases
    for c in cases:
        assert c["tokens"] == 5 * 6 and c["kl"] >= 0 and c["max_abs_dlogprob"] > 0
    assert replayed["router_flip_rate"] == 0.0  # the trainer ran exactly the engine's experts
    assert plain["router_flip_rate"] == plain["router_own_flip_rate"]
    assert mismatch.summarize(cases)["replay_flip_rate_max"] == 0.0
