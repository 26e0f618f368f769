"""`rlbus bench codec --device --state-gb` (`rlbus_tools.bench.codec_speed`): the states it makes have the shapes
and the share of changed elements it claims, and a small run decodes bit for bit beside its floors."""

from __future__ import annotations

import math

import pytest

from rlbus_tools.bench import codec_speed


def test_smollm2_size_is_smollm2_135m_layout_and_larger_states_use_larger_families() -> None:
    layout = codec_speed.shapes(0.27)
    assert sum(math.prod(s) for s in layout.values()) == 134_515_008  # SmolLM2-135M, tied embedding
    assert layout["layers.000.k"] == (192, 576) and len([k for k in layout if k.endswith(".q")]) == 30
    big = codec_speed.shapes(1.4)
    assert big["layers.000.q"] == (2048, 2048)
    assert abs(sum(math.prod(s) for s in big.values()) * 2 / 1e9 - 1.4) < 0.1
    assert codec_speed.shapes(14.0)["layers.000.gate"] == (14336, 4096)


def test_a_small_run_is_bit_exact_with_the_asked_share_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_speed, "FAMILIES", ((math.inf, 128, 64, 256, 1024, True),))
    result = codec_speed.run(device="cpu", sizes=[0.004], quick=True)
    (row,) = result["rows"]
    assert row["bit_exact"] and result["summary"]["bit_exact"]
    assert 0.03 < row["changed_fraction"] < 0.055
    assert set(row["floors_gb_s"]) == {"copy", "xor", "xor_nonzero_gather", "scatter"}
    assert row["encode_gb_s_1"] > 0 and row["decode_apply_gb_per_cpu_s_all"] > 0
    judged = row["targets"]["decode_apply"]  # per core: one thread's bytes over its own CPU seconds
    assert judged["gb_s"] == row["decode_apply_gb_per_cpu_s_1"] and judged["target_gb_s"] == 1.0
    assert judged["met"] == (judged["gb_s"] >= 1.0)
    assert set(result["summary"]["targets_met"]) == {"encode", "decode_apply"}
