"""Weight codec: bit-exact round trips, chunk integrity, coalescing and pinned byte layouts."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import njit

from rlbus.errors import ChunkCorrupt, WeightSyncError
from rlbus.weights import codec
from rlbus.weights.apply import apply_update_
from rlbus.weights.codec import (
    _kernels,
    _simd,
    apply_chunk_,
    apply_delta,
    apply_delta_,
    decode_chunk,
    decode_delta,
    decode_keyframe,
    encode_delta,
    encode_keyframe,
    encode_state_delta,
    encode_state_keyframe,
    load_keyframe,
)
from rlbus.weights.digest import state_digest

FLOATS = [torch.bfloat16, torch.float16, torch.float32]
INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> np.ndarray:
    """Raw bit patterns as an unsigned numpy array (compares NaN payloads and -0.0 exactly)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def from_bits(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    signed = np.int16 if torch.empty(0, dtype=dtype).element_size() == 2 else np.int32
    return torch.from_numpy(raw.astype(signed)).view(dtype).reshape(shape)


def specials(dtype: torch.dtype) -> list[int]:
    """Bit patterns of ±0, ±smallest subnormal, ±Inf, NaNs with payloads, ±max."""
    if dtype == torch.float32:
        return [0, 0x80000000, 1, 0x80000001, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFA5A5A5, 0x7F7FFFFF]
    if dtype == torch.float16:
        return [0, 0x8000, 1, 0x8001, 0x7C00, 0xFC00, 0x7E01, 0xFD55, 0x7BFF]
    return [0, 0x8000, 1, 0x8001, 0x7F80, 0xFF80, 0x7FC1, 0xFFAA, 0x7F7F]


def make_old(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Realistic weights (many magnitudes) mixed with random bit patterns, specials and tiny values."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) if shape else 1
    width = 32 if dtype == torch.float32 else 16
    real = torch.from_numpy(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0, n)).to(dtype)
    old = bits(real).astype(np.int64) & ((1 << width) - 1)
    mixed = rng.random(n)
    old = np.where(mixed < 0.05, rng.integers(0, 1 << width, n), old)
    spec = np.array(specials(dtype), dtype=np.int64)
    old = np.where((mixed >= 0.05) & (mixed < 0.08), spec[rng.integers(0, len(spec), n)], old)
    tiny = (mixed >= 0.08) & (mixed < 0.12)
    old = np.where(tiny, rng.integers(0, 4, n) | (rng.integers(0, 2, n) << (width - 1)), old)
    return from_bits(old.astype(np.uint32 if width == 32 else np.uint16), dtype, shape)


def perturb(old: torch.Tensor, seed: int, frac: float) -> torch.Tensor:
    """Change a fraction of elements by: a few units in the last place (crossing zero where the value
    is tiny), a relative float perturbation, a random bit pattern, or a special value."""
    rng = np.random.default_rng(seed)
    dtype = old.dtype
    n = old.numel()
    width = 32 if dtype == torch.float32 else 16
    ob = bits(old).astype(np.int64) & ((1 << width) - 1)
    change = rng.random(n) < frac
    kind = rng.integers(0, 4, n)
    mag = ob & ((1 << (width - 1)) - 1)
    ordv = np.where(ob >> (width - 1), -mag - 1, ob)
    step = rng.choice([-3, -2, -1, 1, 1, 2, 3], n)
    o2 = np.clip(ordv + step, -(1 << (width - 1)), (1 << (width - 1)) - 1)
    stepped = np.where(o2 < 0, (-o2 - 1) | (1 << (width - 1)), o2)
    noise = 1 + 1e-2 * torch.from_numpy(rng.standard_normal(n)).float()
    pert = bits((old.reshape(-1).float() * noise).to(dtype)).astype(np.int64) & ((1 << width) - 1)
    spec = np.array(specials(dtype), dtype=np.int64)
    choice = np.select(
        [kind == 0, kind == 1, kind == 2],
        [stepped, pert, rng.integers(0, 1 << width, n)],
        spec[rng.integers(0, len(spec), n)],
    )
    new = np.where(change, choice, ob)
    return from_bits(new.astype(np.uint32 if width == 32 else np.uint16), dtype, tuple(old.shape))


def make_pair(seed: int, dtype: torch.dtype, shape: tuple[int, ...], frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    old = make_old(seed, dtype, shape)
    return old, perturb(old, seed + 1, frac)


def mode_of(blob: bytes) -> int:
    r = codec.Reader(blob)
    codec._read_header(r, blob[1])
    return r.u8()


shapes = st.sampled_from([(), (0,), (1,), (7,), (3, 0), (64,), (5, 13), (300,), (33, 65)])
fracs = st.sampled_from([0.0, 0.002, 0.03, 0.2, 0.7, 1.0])


# ------------------------------------------------------------------------------------- tensor deltas


@FAST
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(FLOATS), shape=shapes, frac=fracs)
def test_delta_round_trip_is_bit_exact(seed: int, dtype: torch.dtype, shape: tuple[int, ...], frac: float) -> None:
    old, new = make_pair(seed, dtype, shape, frac)
    before = old.clone()
    blob = encode_delta(old, new)
    assert same_bits(apply_delta(old, blob), new)
    assert same_bits(old, before), "apply_delta must not modify its input"
    update = decode_delta(old, blob)
    changed = int((bits(old) != bits(new)).sum())
    assert update.changed == changed or update.dense is not None
    t = old.clone()
    apply_update_(t, update)
    assert same_bits(t, new)
    t = old.clone()
    apply_delta_(t, blob)
    assert same_bits(t, new)


@pytest.mark.parametrize("dtype", FLOATS)
def test_large_realistic_delta_is_small_and_exact(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    master = torch.randn(200_000) * 0.02
    old = master.to(dtype)
    step = {torch.bfloat16: 6e-6, torch.float16: 8e-7, torch.float32: 1e-10}[dtype]  # ~5 % of an ulp at 0.02
    new = (master.double() + step * torch.randn_like(master).sign().double()).to(dtype)
    blob = encode_delta(old, new)
    assert mode_of(blob) == codec.SPARSE
    assert same_bits(apply_delta(old, blob), new)
    changed = int((bits(old) != bits(new)).sum())
    assert 0 < changed < old.numel() // 4
    assert len(blob) * 8 < changed * 12, "sparse path should cost well under 12 bits per change"


def test_none_changed_and_all_changed() -> None:
    old, _ = make_pair(1, torch.bfloat16, (4096,), 0.0)
    blob = encode_delta(old, old.clone())
    assert mode_of(blob) == codec.SAME and len(blob) < 12
    assert same_bits(apply_delta(old, blob), old)
    new = from_bits((bits(old).astype(np.int64) ^ 1).astype(np.uint16), torch.bfloat16, (4096,))
    assert same_bits(apply_delta(old, encode_delta(old, new)), new)
    rand = from_bits(np.random.default_rng(2).integers(0, 1 << 16, 4096).astype(np.uint16), torch.bfloat16, (4096,))
    blob = encode_delta(old, rand)
    assert same_bits(apply_delta(old, blob), rand)
    assert len(blob) <= 4096 * 2 + 16, "random data falls back to RAW"


@pytest.mark.parametrize("dtype", FLOATS)
def test_sign_crossings_and_special_values(dtype: torch.dtype) -> None:
    width = 32 if dtype == torch.float32 else 16
    sign = 1 << (width - 1)
    spec = specials(dtype)
    old_bits = [0, sign, 1, sign | 1, 2, sign | 2, *spec, *spec]
    new_bits = [sign, 0, sign | 1, 1, sign | 3, 3, *spec[::-1], *(s ^ 1 for s in spec)]
    udt = np.uint32 if width == 32 else np.uint16
    old = from_bits(np.array(old_bits, dtype=udt), dtype, (len(old_bits),))
    new = from_bits(np.array(new_bits, dtype=udt), dtype, (len(new_bits),))
    assert same_bits(apply_delta(old, encode_delta(old, new)), new)
    fmt = codec._FLOATS[dtype]
    assert [_kernels._ord(b, width - 1, fmt.mag_mask) for b in (0, sign, sign | 1, 1)] == [0, -1, -2, 1]


def test_delta_rejects_mismatched_inputs() -> None:
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        encode_delta(a, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        encode_delta(a, torch.zeros(4, dtype=torch.float16))
    blob = encode_delta(a, a + 1)
    with pytest.raises(WeightSyncError):
        decode_delta(torch.zeros(4, dtype=torch.float16), blob)


def test_non_float_dtypes_use_dense_modes() -> None:
    old = torch.arange(1000, dtype=torch.int64)
    new = old.clone()
    new[17] = -5
    assert same_bits(apply_delta(old, encode_delta(old, new)), new)
    b = torch.zeros(100, dtype=torch.bool)
    b2 = b.clone()
    b2[3] = True
    assert same_bits(apply_delta(b, encode_delta(b, b2)), b2)


# ---------------------------------------------------------------------------------------- keyframes


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([*FLOATS, torch.float64, torch.int64, torch.int8, torch.bool]),
    shape=shapes,
)
def test_keyframe_round_trip(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if dtype in FLOATS:
        t = make_old(seed, dtype, shape)
    else:
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(-100, 100, shape, generator=g).to(dtype)
    back = decode_keyframe(encode_keyframe(t))
    assert same_bits(back, t)


def test_bf16_keyframe_compresses_real_weights() -> None:
    torch.manual_seed(0)
    t = (torch.randn(256, 1024) * 0.05).to(torch.bfloat16)
    blob = encode_keyframe(t)
    assert same_bits(decode_keyframe(blob), t)
    assert len(blob) < 0.72 * t.numel() * 2  # exponent plane entropy-coded, mantissa bytes stored


# ------------------------------------------------------------------------------------ state chunks


def make_state(seed: int, sizes: list[int]) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    state: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        dtype = rng.choice([*FLOATS, torch.bfloat16, torch.bfloat16])
        shape = (n,) if rng.random() < 0.5 or n == 0 else (1, n)
        state[f"layer.{i:02d}.w"] = make_old(seed * 100 + i, dtype, shape)
    state["buffers.position_ids"] = torch.arange(40, dtype=torch.int64).reshape(1, 40)
    state["scalar"] = torch.tensor(0.5, dtype=torch.bfloat16)
    return state


def evolve(state: dict[str, torch.Tensor], seed: int, frac: float) -> dict[str, torch.Tensor]:
    return {
        name: perturb(t, seed * 1000 + i, frac) if t.dtype in FLOATS else t.clone()
        for i, (name, t) in enumerate(sorted(state.items()))
    }


sizes_st = st.lists(st.sampled_from([0, 1, 5, 100, 700, 3000, 9000]), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), sizes=sizes_st, chunk_bytes=st.sampled_from([1024, 3000, 1 << 20]))
def test_state_delta_and_keyframe_round_trip(seed: int, sizes: list[int], chunk_bytes: int) -> None:
    old = make_state(seed, sizes)
    new = evolve(old, seed, 0.05)
    chunks = encode_state_delta(old, new, chunk_bytes)
    assert all(c.size <= chunk_bytes for c in chunks)
    assert all(c.hash == codec.chunk_hash(c.data) for c in chunks)
    state = {k: v.clone() for k, v in old.items()}
    for c in random.Random(seed).sample(chunks, len(chunks)):  # chunks are independent: any order
        apply_chunk_(state, c.data, expected_hash=c.hash)
    assert state_digest(state) == state_digest(new)
    assert all(same_bits(state[k], new[k]) for k in new)

    kf = encode_state_keyframe(new, chunk_bytes)
    assert all(c.size <= chunk_bytes for c in kf)
    covered = {r.name for c in kf for r in c.tensors}
    assert covered == set(new)
    loaded = load_keyframe([c.data for c in kf], hashes=[c.hash for c in kf])
    assert state_digest(loaded) == state_digest(new)


def test_chunks_split_large_tensors_and_cover_ranges() -> None:
    big_old, big_new = make_pair(3, torch.bfloat16, (20_000,), 1.0)
    old = {"big": big_old, "small": torch.zeros(10, dtype=torch.float32)}
    new = {"big": big_new, "small": torch.ones(10, dtype=torch.float32)}
    chunks = encode_state_delta(old, new, chunk_bytes=8192)
    assert len(chunks) > 2
    ranges = sorted((r.name, r.start, r.stop) for c in chunks for r in c.tensors)
    big = [(a, b) for n, a, b in ranges if n == "big"]
    assert big[0][0] == 0 and big[-1][1] == 20_000
    assert all(b1 == a2 for (_, b1), (a2, _) in itertools.pairwise(big))
    state = {k: v.clone() for k, v in old.items()}
    apply_chunk_(state, chunks[0].data)  # one chunk alone changes exactly its ranges
    first = chunks[0].tensors[0]
    span = slice(first.start, first.stop)
    assert same_bits(state[first.name].reshape(-1)[span], new[first.name].reshape(-1)[span])
    assert same_bits(state[first.name].reshape(-1)[first.stop :], old[first.name].reshape(-1)[first.stop :])


def test_unchanged_state_has_no_chunks_and_parallel_paths_agree() -> None:
    state = make_state(5, [3000, 9000, 700])
    assert encode_state_delta(state, {k: v.clone() for k, v in state.items()}) == []
    new = evolve(state, 5, 0.1)
    one = encode_state_delta(state, new, 4096)
    many = encode_state_delta(state, new, 4096, threads=4)
    assert [c.data for c in one] == [c.data for c in many]
    s1 = {k: v.clone() for k, v in state.items()}
    for c in one:
        apply_chunk_(s1, c.data, threads=3)
    assert state_digest(s1) == state_digest(new)


def test_coalesced_delta_equals_the_chain() -> None:
    a = make_state(9, [3000, 9000, 1])
    b = evolve(a, 10, 0.03)
    c = evolve(b, 11, 0.03)
    chained = {k: v.clone() for k, v in a.items()}
    for step in (encode_state_delta(a, b), encode_state_delta(b, c)):
        for ch in step:
            apply_chunk_(chained, ch.data)
    direct = {k: v.clone() for k, v in a.items()}
    for ch in encode_state_delta(a, c):
        apply_chunk_(direct, ch.data)
    assert state_digest(chained) == state_digest(direct) == state_digest(c)
    t = apply_delta(a["layer.01.w"], encode_delta(a["layer.01.w"], c["layer.01.w"]))
    assert same_bits(t, c["layer.01.w"])


def test_decode_chunk_rejects_a_state_of_another_layout() -> None:
    old = make_state(4, [700])
    new = evolve(old, 4, 0.5)
    (chunk,) = encode_state_delta(old, new)
    wrong = {k: v.clone() for k, v in old.items()}
    wrong["layer.00.w"] = torch.zeros(3, dtype=wrong["layer.00.w"].dtype)
    with pytest.raises(WeightSyncError):
        decode_chunk(wrong, chunk.data)


# ------------------------------------------------------------------------------- corruption


def corrupt_cases() -> tuple[dict[str, torch.Tensor], list[codec.Chunk]]:
    old = make_state(21, [3000, 700, 5])
    new = evolve(old, 21, 0.05)
    return old, encode_state_delta(old, new, chunk_bytes=1 << 20) + encode_state_keyframe(new, 1 << 20)


def test_corrupt_or_truncated_chunk_raises_and_leaves_state_untouched() -> None:
    old, chunks = corrupt_cases()
    rng = random.Random(0)
    for chunk in chunks:
        state = {k: v.clone() for k, v in old.items()}
        digest = state_digest(state)
        data = bytearray(chunk.data)
        for pos in rng.sample(range(len(data)), min(60, len(data))):
            bad = bytearray(data)
            bad[pos] ^= 1 << rng.randrange(8)
            for expected in (chunk.hash, None):
                with pytest.raises(ChunkCorrupt):
                    apply_chunk_(state, bytes(bad), expected_hash=expected)
        for cut in [0, 1, 5, len(data) // 2, len(data) - 1]:
            with pytest.raises(ChunkCorrupt):
                apply_chunk_(state, bytes(data[:cut]))
        with pytest.raises(ChunkCorrupt):
            apply_chunk_(state, chunk.data, expected_hash="0" * 32)
        assert state_digest(state) == digest


def test_decoder_survives_damage_behind_a_valid_checksum() -> None:
    """Bytes damaged *before* checksumming (an encoder-side bug, a hostile peer) must still never crash
    the worker or half-apply: decoding either fails with a typed error or yields a full update."""
    import xxhash

    old, chunks = corrupt_cases()
    rng = random.Random(1)
    for chunk in chunks:
        body = bytearray(chunk.data[:-8])
        for _ in range(150):
            bad = bytearray(body)
            for _ in range(rng.randint(1, 3)):
                bad[rng.randrange(len(bad))] = rng.randrange(256)
            if rng.random() < 0.3:
                bad = bad[: rng.randrange(len(bad))]
            data = bytes(bad) + xxhash.xxh3_64_intdigest(bytes(bad)).to_bytes(8, "little")
            state = {k: v.clone() for k, v in old.items()}
            digest = state_digest(state)
            try:
                apply_chunk_(state, data)
            except (ChunkCorrupt, WeightSyncError):
                assert state_digest(state) == digest


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(FLOATS))
def test_damaged_tensor_blob_raises_typed_errors_only(seed: int, dtype: torch.dtype) -> None:
    old, new = make_pair(seed, dtype, (2000,), 0.05)
    blob = bytearray(encode_delta(old, new))
    rng = random.Random(seed)
    for _ in range(20):
        bad = bytearray(blob)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        if rng.random() < 0.3:
            bad = bad[: rng.randrange(len(bad))]
        try:
            decode_delta(old, bytes(bad))
        except (ChunkCorrupt, WeightSyncError):
            pass


# ---------------------------------------------------------------------------------- bit helpers


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stage_and_swap() -> None:
    old, new = make_pair(8, torch.bfloat16, (100_000,), 0.03)
    blob = encode_delta(old.cuda(), new.cuda())
    assert blob == encode_delta(old, new)
    t = old.cuda()
    update = decode_delta(t, blob).to("cuda")
    apply_update_(t, update)
    assert same_bits(t, new)


# ------------------------------------------------------------------------------- digests and goldens


def test_state_digest_is_canonical_and_sensitive() -> None:
    a = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3), "y": torch.zeros(2, dtype=torch.bfloat16)}
    b = {"y": a["y"].clone(), "x": a["x"].clone()}
    assert state_digest(a) == state_digest(b)
    assert state_digest(a) == "e27caf625fe72c3c212b408172154c0a"
    variants = [
        {**a, "x": a["x"].reshape(3, 2)},
        {**a, "y": a["y"].to(torch.float16)},
        {"x2": a["x"], "y": a["y"]},
        {**a, "y": torch.tensor([0.0, -0.0], dtype=torch.bfloat16)},
    ]
    assert len({state_digest(v) for v in variants} | {state_digest(a)}) == 5


def golden_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """1024 bf16 weights: tiny ones (2^-20..2^-23) of which half move by 1..12 ulp, and larger ones
    (2^-3..2^-5) of which a few move by one ulp, so the blob has several position and value classes,
    level sequences and a Rice tail."""
    i = torch.arange(1024)
    mag = torch.where(i < 512, 2.0 ** -(20 + i % 4), 2.0 ** -(3 + i % 3))
    old = (mag * (1 + (i % 7) / 8.0) * torch.where(i % 2 == 0, 1.0, -1.0)).to(torch.bfloat16)
    b = old.view(torch.int16).clone()
    small = torch.arange(0, 512, 2)
    b[small] += ((small % 12) + 1).to(torch.int16) * torch.where(small % 4 == 0, 1, -1).to(torch.int16)
    big = torch.arange(512, 1024, 37)
    b[big] += torch.where(big % 2 == 0, 1, -1).to(torch.int16)
    return old, b.view(torch.bfloat16)


# Sparse delta of golden_pair(): K = 5 position classes, V = 2 value classes, levels and a tail.
GOLDEN_DELTA = (
    "0101010180080105696a6b7a026b80018e010080010080010e048001558080015555805502014c49922449924992244992"
    "2449922449922449922449ff7f922449922449922449922449922449b26ddbb66ddbb66ddbb66ddbb66ddbb69d999999999999"
    "9999999999999999999999999999192740444444444444ffffffffffffffffffffffffffffffffffffffffffffffffffffff"
    "ffffffff7fffffffffffffffffffffffffffffffff000000000000000000000000000000000000"
)
# Delta chunk of {"w": first 64, "b": next 16 elements}: table stored (too small for zstd to pay off).
GOLDEN_CHUNK = (
    "524c42570101000b02016201011001770101400102000010010040012e01012828002181211a810117555555555555555555"
    "554a92a424c9125b628925965822057ec0ffffffaaaaaaaaaaf7c4ca4dffc676b3"
)
# Keyframe (PLANES, zstd exponent plane) of golden_pair()[1][512:640]. Encoding is pinned only through
# decoding, since zstd's output may differ between library versions while its format does not.
GOLDEN_KEYFRAME = (
    "0102010208100402011628b52ffd20806d0000207a7c7b7902006f4044327543013028b52ffd20803d0100b811a030c050e0"
    "009020b040d0608010afb05150ff8010a00600e010a01c381850041c5728b30e"
)


def test_golden_delta_bytes() -> None:
    old, new = golden_pair()
    assert encode_delta(old, new).hex() == GOLDEN_DELTA
    assert same_bits(apply_delta(old, bytes.fromhex(GOLDEN_DELTA)), new)


def test_golden_chunk_bytes() -> None:
    old, new = golden_pair()
    (chunk,) = encode_state_delta({"w": old[:64], "b": old[64:80]}, {"w": new[:64], "b": new[64:80]})
    assert chunk.data.hex() == GOLDEN_CHUNK
    state = {"w": old[:64].clone(), "b": old[64:80].clone()}
    apply_chunk_(state, bytes.fromhex(GOLDEN_CHUNK))
    assert same_bits(state["w"], new[:64]) and same_bits(state["b"], new[64:80])


def test_golden_keyframe_decodes() -> None:
    _, new = golden_pair()
    t = new[512:640].reshape(8, 16)
    blob = bytes.fromhex(GOLDEN_KEYFRAME)
    assert mode_of(blob) == codec.PLANES
    assert same_bits(decode_keyframe(blob), t)
    assert same_bits(decode_keyframe(encode_keyframe(t)), t)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 9000),
    thresholds=st.lists(st.integers(1, 255), max_size=7, unique=True).map(sorted),
    frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
)
def test_class_kernels_match_a_brute_force_reference(seed: int, n: int, thresholds: list[int], frac: float) -> None:
    """Word-mask scans, class counts, ranks and selects (blocks of 64-element words, a scalar tail) agree
    with per-element counting."""
    rng = np.random.default_rng(seed)
    key = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    key[rng.random(n) < 0.5] = key[0] if n else 0  # long runs of one class: whole words of one class
    exp = (key.astype(np.int64) >> 7) & 0xFF
    cls_of = np.searchsorted(np.asarray(thresholds, dtype=np.int64), exp, side="right")
    pos = np.flatnonzero(rng.random(n) < frac)
    changed = key.copy()
    changed[pos] ^= 1
    found, exps, d, hist, _, sampled, _ = _kernels.scan_changes(key, changed, 0x7FFF, 7, 15, 256, 3, 3)
    assert np.array_equal(found, pos) and np.array_equal(exps, exp[pos])
    assert np.array_equal(hist, np.bincount(exp[pos], minlength=256))
    assert np.array_equal(sampled, 3 * np.bincount(exp[::3], minlength=256))
    thr = np.asarray(thresholds, dtype=np.uint16) << np.uint16(7)
    magmask = np.uint16(0x7FFF)
    lut = codec._class_lut(thresholds)
    nclass = len(thresholds) + 1
    offsets = np.concatenate([[0], np.cumsum(np.bincount(cls_of[pos], minlength=nclass))])
    counts, ranks, cm_exp, _, _ = _kernels.class_major(key, magmask, thr, lut, pos, exps, d, offsets)
    assert np.array_equal(counts, np.bincount(cls_of, minlength=nclass))
    assert np.array_equal(_kernels.class_counts(key, magmask, thr), counts)
    order = np.argsort(cls_of[pos], kind="stable")  # class-major order of the changes
    expect = [int((cls_of[:p] == cls_of[p]).sum()) for p in pos[order]]
    assert ranks.tolist() == expect and np.array_equal(cm_exp, exp[pos[order]])
    start = np.concatenate([[0], np.cumsum(64 * ((counts + 63) // 64 + 1))])
    bm = np.zeros(start[-1] // 64 + 1, dtype=np.uint64)
    for c, r in zip(cls_of[pos[order]], ranks, strict=True):
        bm[(start[c] + r) >> 6] |= np.uint64(1) << np.uint64((start[c] + r) & 63)
    sizes, masks = _kernels.class_masks(key, magmask, thr)
    assert np.array_equal(sizes, counts)
    got, cm, old_cm, err = _kernels.select(key, magmask, 7, thr, lut, counts, masks, start, bm, offsets)
    assert err == 0 and np.array_equal(got, pos)
    assert np.array_equal(pos[order][cm], pos) and np.array_equal(old_cm, key[pos[order]])


@njit
def _pdep_in_use(src: np.uint64, mask: np.uint64) -> np.uint64:
    return _simd.pdep(src, mask)


@settings(max_examples=200, deadline=None)
@given(src=st.integers(0, 2**64 - 1), mask=st.integers(0, 2**64 - 1))
def test_bit_deposit_and_select_match_their_definitions(src: int, mask: int) -> None:
    """The portable pdep (broadword select per source bit) and the one in use agree with the definition."""
    ones = [i for i in range(64) if mask >> i & 1]
    src &= (1 << len(ones)) - 1
    expect = sum(1 << ones[j] for j in range(len(ones)) if src >> j & 1)
    assert int(_simd._pdep_soft(np.uint64(src), np.uint64(mask))) == expect
    assert int(_pdep_in_use(np.uint64(src), np.uint64(mask))) == expect
    assert [_simd.select64(np.uint64(mask), j) for j in range(len(ones))] == ones


def test_decoding_runs_in_parallel_threads() -> None:
    """The kernels release the GIL; concurrent decodes of one chunk agree bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    old = make_state(31, [300_000, 70_000])
    new = evolve(old, 31, 0.03)
    chunks = encode_state_delta(old, new)

    def decode(_: int) -> dict[str, torch.Tensor]:
        state = {k: v.clone() for k, v in old.items()}
        for c in chunks:
            apply_chunk_(state, c.data)
        return state

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(decode, range(4)))
    assert all(state_digest(r) == state_digest(new) for r in results)


def test_class_choices_of_a_batch_are_each_records_own() -> None:
    """The GPU coder chooses every record's classes in one batched call; each must be what the record gets
    alone (the CPU coder's call), so both write the same bytes."""
    from rlbus.weights.codec import classes

    stats = []
    g = torch.Generator().manual_seed(0)
    for seed in range(24):
        master = torch.randn(2000 + 1000 * seed, generator=g) * 10.0 ** (-seed % 3)
        step = (1e-3 if seed % 2 else 3e-2) * 10.0 ** (-seed % 3) * torch.randn(master.shape, generator=g)
        old, new = master.to(torch.bfloat16), (master + step).to(torch.bfloat16)
        stats.append(_kernels.scan_changes(bits(old).view(np.uint16), bits(new).view(np.uint16), 0x7FFF, 7, 15,
                                           256, 3, 2))
    hist = np.stack([s[3] for s in stats])
    above = np.stack([s[4] for s in stats], axis=1)
    tmax = np.array([s[6] for s in stats])
    sampled = np.stack([s[5] for s in stats])

    def tails(r: int, kmax: int) -> np.ndarray:
        return _kernels.tail_sums(stats[r][1], stats[r][2], 256, 3, kmax)

    batch_pos = classes.choose_thresholds(sampled, hist)
    batch_val = classes.choose_value_thresholds(hist, above, tmax, tails)
    assert len({len(t) for t in batch_pos}) > 1  # records of different class counts in one batch
    for r in range(len(stats)):
        assert batch_pos[r] == classes._choose_thresholds(sampled[r], hist[r])
        assert batch_val[r] == classes._choose_value_thresholds(hist[r], above[:, r], int(tmax[r]),
                                                                lambda k, r=r: tails(r, k))
