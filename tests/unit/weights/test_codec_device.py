"""The accelerator path of the SPARSE coder (`rlbus.weights.codec.device`, torch ops) run on CPU tensors: it
must produce the CPU kernels' bytes and decode them to the same bits, so a delta encoded where the weights
live (a GPU) is the delta the CPU would have written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.errors import ChunkCorrupt
from rlbus.weights.codec import (
    _kernels,
    apply_chunk_,
    apply_delta,
    encode_delta,
    encode_state_delta,
    sparse,
)
from rlbus.weights.codec.device import class_ranks, class_select, classes, exponents
from rlbus.weights.codec.format import _FLOATS
from rlbus.weights.codec.sparse import _Bits
from tests.unit.weights.test_codec import FLOATS, evolve, make_pair, make_state, same_bits


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sparse, "FORCE_TORCH_OPS", True)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from(FLOATS), n=st.sampled_from([1, 63, 64, 65, 5000, 70_000]),
       frac=st.sampled_from([0.001, 0.03, 0.3, 0.8]))
def test_the_device_path_writes_the_kernels_bytes_and_reads_them_back(
    seed: int, dtype: torch.dtype, n: int, frac: float
) -> None:
    old, new = make_pair(seed, dtype, (n,), frac)
    blob = encode_delta(old, new)
    sparse.FORCE_TORCH_OPS = True
    try:
        assert encode_delta(old, new) == blob
        assert same_bits(apply_delta(old, blob), new)
    finally:
        sparse.FORCE_TORCH_OPS = False


def test_a_state_delta_through_the_device_path_is_identical(torch_ops: None) -> None:
    old = make_state(3, [9000, 700, 5, 3000])
    new = evolve(old, 3, 0.04)
    chunks = encode_state_delta(old, new, chunk_bytes=4096)
    sparse.FORCE_TORCH_OPS = False
    assert [c.data for c in chunks] == [c.data for c in encode_state_delta(old, new, chunk_bytes=4096)]
    sparse.FORCE_TORCH_OPS = True
    held = {k: v.clone() for k, v in old.items()}
    for c in chunks:
        apply_chunk_(held, c.data, expected_hash=c.hash)
    assert all(same_bits(held[k], new[k]) for k in new)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000),
       thresholds=st.lists(st.integers(1, 255), max_size=7, unique=True).map(sorted),
       frac=st.sampled_from([0.01, 0.3, 1.0]))
def test_class_ops_match_the_kernels(seed: int, n: int, thresholds: list[int], frac: float) -> None:
    rng = np.random.default_rng(seed)
    key = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    pos = np.flatnonzero(rng.random(n) < frac)
    bits = _Bits(torch.from_numpy(key.view(np.int16)).view(torch.bfloat16), _FLOATS[torch.bfloat16])
    k_counts, k_cls, k_ranks = bits.class_ranks(thresholds, pos)
    cls = classes(exponents(bits._device(), bits.fmt), thresholds)
    counts, at, ranks = class_ranks(cls, len(thresholds) + 1, pos)
    assert np.array_equal(counts, k_counts) and np.array_equal(at, k_cls) and np.array_equal(ranks, k_ranks)
    order = np.argsort(at, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(at, minlength=len(thresholds) + 1))])
    want = bits.class_select(thresholds, counts, ranks[order], offsets)
    got = class_select(bits._device(), cls, counts, ranks[order], offsets, bits.fmt)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    if len(pos):
        bad = ranks[order].copy()
        bad[-1] = counts[at[order][-1]]  # a rank past its class
        with pytest.raises(ChunkCorrupt):
            class_select(bits._device(), cls, counts, bad, offsets, bits.fmt)
    assert _kernels.class_counts(key, np.uint16(0x7FFF), bits.boundaries(thresholds)).tolist() == counts.tolist()
