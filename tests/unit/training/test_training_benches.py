"""The mismatch and train benchmarks at toy sizes: their figures are well-formed and replay's guarantees hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.models.policy import PolicyConfig
from rlbus_tools.bench import mismatch, train


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


@pytest.mark.slow
def test_train_bench_on_two_ranks_reproduces_one_rank_and_halves_the_sharded_bytes(tmp_path: Path) -> None:
    """``rlbus bench train --world-size 2 --quick``: the figures are there, the model + optimizer bytes per
    rank halve, and the exactness checks it reports pass (they compare for real: a mismatch fails here)."""
    result = train.run(quick=True, json_path=tmp_path / "ranks.json", world_size=2)
    summary = result["summary"]
    assert summary["matches_single_process"] is True
    assert summary["delta_chain_bit_exact"] is True
    assert result["losses"]["1"] == result["losses"]["2"]
    one, two = summary["model_optimizer_mb_per_rank"]["1"], summary["model_optimizer_mb_per_rank"]["2"]
    assert len(two) == 2 and all(mb == pytest.approx(one[0] / 2, rel=0.01) for mb in two)
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["publish_s"] > 0 and row["save_s"] > 0 and row["load_s"] > 0
        assert row["rss_peak_mb"] > row["model_optimizer_mb"]
    assert json.loads((tmp_path / "ranks.json").read_text())["summary"] == summary


def test_train_flops_are_the_hand_count_and_mfu_divides_by_the_peak() -> None:
    """``--size 1.5b``'s path (a random transformers model) at toy size, and the FLOP count MFU rests on."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      max_position_embeddings=64)  # fmt: skip
    size = train.Size("toy-hf", train.dense_config(True), groups=2, group_size=2, prompt=4, completion=6, steps=1,
                      hf_config=config)  # fmt: skip
    model = train.build_model(size)
    body = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32)  # per layer: q, k and v (GQA), o, gate, up, down
    positions, trained = 4 * 9, 4 * 6
    attention = 12 * 2 * 32 * 10 * positions  # 12 · layers · d · T per position
    assert train.train_flops(model, size) == 6 * body * positions + 6 * 272 * 32 * trained + attention
    row = train.measure(size, replay=False, peak=1e9)
    assert row["mfu"] == pytest.approx(row["model_flops_per_s"] / 1e9) and row["compute"] == "fp32"
    peak = train.matmul_peak("cpu", seconds=0.05)
    assert peak["flops_per_s"] > 0 and peak["samples"] >= 10
