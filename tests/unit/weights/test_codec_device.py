"""The SPARSE coder for records on an accelerator (`rlbus.weights.codec.device`, Triton kernels in
`rlbus.weights.codec._triton`), run on CPU tensors by Triton's interpreter: every kernel agrees with its CPU
counterpart, and batches of records encode to the CPU coder's bytes and decode to its bits, accepting and
rejecting damaged payloads exactly as it does. Sizes are small: the interpreter runs a program at a time."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on CPU tensors

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.errors import ChunkCorrupt
from rlbus.weights.bitview import np_bits
from rlbus.weights.codec import _kernels, apply_chunk_, apply_delta, device, encode_delta, encode_state_delta, sparse
from rlbus.weights.codec._bits import Reader
from rlbus.weights.codec.classes import _class_lut
from rlbus.weights.codec.format import _FLOATS
from tests.unit.weights.test_codec import FLOATS, evolve, make_pair, make_state, same_bits

SHAPES = [(5000, 0.03), (63, 0.3), (9000, 0.6), (1, 1.0), (300, 0.0), (12000, 0.002), (4100, 1.0), (700, 0.2)]


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "ON_CPU", True)


def _records(seed: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_pair(seed * 10 + i, dtype, (n,), frac) for i, (n, frac) in enumerate(SHAPES)]


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from(FLOATS))
def test_a_batch_encodes_to_the_cpu_bytes_and_decodes_to_its_bits(seed: int, dtype: torch.dtype) -> None:
    fmt = _FLOATS[dtype]
    pairs = _records(seed, dtype)
    got = device.encode_records([o for o, _ in pairs], [n for _, n in pairs], fmt)
    want = [sparse.encode_sparse(np_bits(o), np_bits(n), fmt) for o, n in pairs]
    assert got == want
    kept = [(o, b) for (o, _), b in zip(pairs, want, strict=True) if b is not None]
    payloads = [device.Payload(np.frombuffer(b, np.uint8), 0, len(b)) for _, b in kept]
    found, ends = device.decode_records([o for o, _ in kept], payloads, fmt)
    for (o, b), (pos, bits), end in zip(kept, found, ends, strict=True):
        cpu_pos, cpu_bits = sparse.decode_sparse(np_bits(o), fmt, Reader(b))
        assert end == len(b) and np.array_equal(pos.numpy(), cpu_pos)
        assert np.array_equal(bits.numpy().view(cpu_bits.dtype), cpu_bits)


def test_real_weights_encode_to_the_cpu_bytes() -> None:
    """Gaussian weights after an Adam-like step: dense low-exponent classes, levels and tails as in training."""
    g = torch.Generator().manual_seed(0)
    master = [torch.randn(n, generator=g) * s for n, s in ((20000, 0.02), (6000, 0.1), (3000, 1.0))]
    olds = [w.to(torch.bfloat16) for w in master]
    news = [(w - 3e-4 * torch.randn(w.shape, generator=g).clamp(-3, 3)).to(torch.bfloat16) for w in master]
    fmt = _FLOATS[torch.bfloat16]
    assert device.encode_records(olds, news, fmt) == [sparse.encode_sparse(np_bits(o), np_bits(n), fmt)
                                                      for o, n in zip(olds, news, strict=True)]


def test_damaged_payloads_are_accepted_and_rejected_as_on_the_cpu() -> None:
    rng = random.Random(0)
    outcomes = set()
    for seed in range(4):
        dtype = FLOATS[seed % 3]
        fmt = _FLOATS[dtype]
        old, new = make_pair(seed, dtype, (3000,), [0.02, 0.3, 0.8, 0.05][seed])
        blob = sparse.encode_sparse(np_bits(old), np_bits(new), fmt)
        assert blob is not None
        for _ in range(12):
            bad = bytearray(blob)
            for _ in range(rng.randint(1, 3)):
                bad[rng.randrange(len(bad))] = rng.randrange(256)
            if rng.random() < 0.2:
                bad = bad[: rng.randrange(len(bad))]
            try:
                r = Reader(bytes(bad))
                cpu = (*sparse.decode_sparse(np_bits(old), fmt, r), r.pos)
            except ChunkCorrupt:
                cpu = None
            try:
                buf = np.frombuffer(bytes(bad), np.uint8)
                ((pos, bits),), (end,) = device.decode_records([old], [device.Payload(buf, 0, len(buf))], fmt)
                dev = (pos.numpy(), bits.numpy(), end)
            except ChunkCorrupt:
                dev = None
            assert (cpu is None) == (dev is None)
            if cpu is not None and dev is not None:
                assert np.array_equal(cpu[0], dev[0]) and np.array_equal(cpu[1], dev[1].view(cpu[1].dtype))
                assert cpu[2] == dev[2]
            outcomes.add(cpu is None)
    assert outcomes == {True, False}  # both kinds of damage were seen


def test_state_chunks_through_the_device_path_are_identical(on_cpu: None) -> None:
    old = make_state(3, [9000, 700, 5, 3000])
    new = evolve(old, 3, 0.04)
    chunks = encode_state_delta(old, new, chunk_bytes=4096)
    device.ON_CPU = False
    assert [c.data for c in chunks] == [c.data for c in encode_state_delta(old, new, chunk_bytes=4096)]
    device.ON_CPU = True
    held = {k: v.clone() for k, v in old.items()}
    for c in chunks:
        apply_chunk_(held, c.data, expected_hash=c.hash)
    assert all(same_bits(held[k], new[k]) for k in new)
    one_old, one_new = make_pair(9, torch.float16, (4000,), 0.05)
    blob = encode_delta(one_old, one_new)
    assert same_bits(apply_delta(one_old, blob), one_new)


# ------------------------------------------------------------------------------- kernel by kernel


def _batch(seed: int, n_records: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[int]]]:
    rng = np.random.default_rng(seed)
    olds, news, thresholds = [], [], []
    for i in range(n_records):
        old, new = make_pair(seed + i, torch.bfloat16, (int(rng.integers(1, 9000)),), float(rng.choice([0.01, 0.3])))
        olds.append(old)
        news.append(new)
        thresholds.append(sorted(rng.choice(np.arange(100, 130), int(rng.integers(0, 8)), replace=False).tolist()))
    return olds, news, thresholds


@pytest.mark.parametrize("seed", [0, 1])
def test_each_kernel_matches_the_cpu_kernels(seed: int) -> None:
    from rlbus.weights.codec import _triton as tr

    fmt = _FLOATS[torch.bfloat16]
    olds, news, thresholds = _batch(seed, 4)
    batch, old = device._Batch.of(olds)
    new = torch.cat([n.view(torch.int16) for n in news])
    pos, old_c, new_c, slots = tr.changes(old, new, batch.blocks)
    bounds = device._bounds(thresholds, fmt, old.device)
    counts = tr.class_counts(old, batch.blocks, bounds, fmt.mag_mask)
    bases = tr.class_bases(counts, batch.blocks)
    ranks, cls = tr.class_ranks(old, new, batch.blocks, bounds, fmt.mag_mask, bases, slots, int(pos.numel()))
    rec = batch.record_of(pos)
    per_record = torch.zeros((4, 8), dtype=torch.int64).index_add_(0, batch.blocks.record, counts.to(torch.int64))
    rank_map, map_start = [], []
    for r, (o, n, thr) in enumerate(zip(olds, news, thresholds, strict=True)):
        key, nkey = np_bits(o), np_bits(n)
        found, exps, d, *_ = _kernels.scan_changes(key, nkey, fmt.mag_mask, fmt.mant, 15, 256, 3, 1)
        mine = rec == r
        assert np.array_equal(pos[mine].numpy() - batch.starts[r], found)
        assert np.array_equal(old_c[mine].numpy().view(np.uint16), key[found])
        assert np.array_equal(new_c[mine].numpy().view(np.uint16), nkey[found])
        b = (np.asarray(thr, dtype=np.int64) << fmt.mant).astype(np.uint16)
        lut = _class_lut(thr)
        k = len(thr) + 1
        offsets = np.concatenate([[0], np.cumsum(np.bincount(lut[exps], minlength=k))])
        sizes, cm_ranks, *_ = _kernels.class_major(key, np.uint16(fmt.mag_mask), b, lut, found, exps, d, offsets)
        assert per_record[r, :k].tolist() == sizes.tolist() and not per_record[r, k:].any()
        order = np.argsort(lut[exps], kind="stable")
        assert np.array_equal(ranks[mine].numpy()[order], cm_ranks)
        assert np.array_equal(cls[mine].numpy(), lut[exps])
        # the decoder's select: mark every other change in the rank map and find exactly those
        starts = np.concatenate([[0], np.cumsum(sizes)])
        member = np.zeros(int(sizes.sum()), dtype=np.uint8)
        pick = np.arange(len(found)) % 2 == 0
        member[starts[lut[exps]][pick] + ranks[mine].numpy()[pick]] = 1
        rank_map.append(member)
        map_start.append(np.pad(starts[:-1], (0, 8 - k), constant_values=starts[-1]))
    offs = np.concatenate([[0], np.cumsum([len(x) for x in rank_map])])[:-1]
    table = torch.from_numpy(np.stack(map_start) + offs[:, None])
    sel_pos, sel_cls = tr.select(old, batch.blocks, bounds, fmt.mag_mask, bases, table,
                                 torch.from_numpy(np.concatenate(rank_map)))
    expect = torch.cat([pos[rec == r][::2] for r in range(4)])
    assert torch.equal(sel_pos, expect) and torch.equal(sel_cls, torch.cat([cls[rec == r][::2] for r in range(4)]))
