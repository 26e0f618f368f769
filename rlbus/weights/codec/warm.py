"""Compile the codec's kernels before the first weight sync needs them.

The kernels (:mod:`._kernels`) are numba functions compiled on their first call and cached on disk. On a
machine whose cache is empty the first delta paid for the compilation: 6.8 s to encode and 8.7 s to stage on
2 cores, while the trainer kept training on the previous version. Those seconds are version lag — in
``rlbus demo`` the first run's rollouts arrived too stale to train, and the run stalled. :func:`warm_kernels`
runs every code path of the codec once on a small synthetic model (a sparse delta with each exponent-class
layout the encoder picks, a dense one, a keyframe; encoded, staged and applied, bit-exact), for each dtype
asked, so each kernel is compiled (or loaded from the cache) for every argument type a sync passes it.
Every process that encodes or stages weights calls it before it reports ready (the publisher before its
first version, a rollout worker's weight sync before its first swap); ``rlbus codec warm`` and ``make``
fill the cache at install time, so a process normally only loads machine code (a fraction of a second).

Where the cache lives: numba writes ``*.nbi``/``*.nbc`` files into ``rlbus/weights/codec/__pycache__``
next to the source, or, where that directory is not writable (an installed package owned by root), into
``$NUMBA_CACHE_DIR`` (default: numba's per-user cache directory). An entry is invalidated by a change to
``_kernels.py`` (its modification time and size), another numba or Python version, or another CPU model
(the machine code is compiled for the host's instruction set) — then the next process compiles again. The
word primitives of ``_simd.py`` are inlined into the kernels, and numba does not see a change to them: after
editing ``_simd.py``, touch ``_kernels.py`` (or delete the cache).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

import rlbus.weights.codec._kernels as _kernels
from rlbus.errors import WeightSyncError
from rlbus.weights.bitview import np_bits
from rlbus.weights.codec.format import _FLOATS, LEVELS
from rlbus.weights.codec.sparse import encode_sparse
from rlbus.weights.codec.state import apply_chunk_, encode_state_delta, encode_state_keyframe, load_keyframe

#: The dtypes weight sync ships (the inference copies); each compiles its own kernel specialisations.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_lock = threading.Lock()
_warmed: set[torch.dtype] = set()


def _model(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": (torch.randn(512, 64, generator=g) * 0.02).to(dtype),
        "mlp": (torch.randn(256, 256, generator=g) * 0.05).to(dtype),
        "norm": (1.0 + 0.1 * torch.randn(64, generator=g)).to(dtype),
        "bias": torch.zeros(64, dtype=dtype),
    }


def _steps(state: dict[str, torch.Tensor], seed: int) -> Iterable[dict[str, torch.Tensor]]:
    """Versions after ``state`` that exercise each delta mode: a few ulps on a fraction of the elements
    (SPARSE, at three densities), large moves of a few (SPARSE with wide values), everything (XOR/RAW)."""
    g = torch.Generator().manual_seed(seed)
    for density, scale in ((0.002, 1e-3), (0.03, 1e-3), (0.3, 1e-2), (0.01, 1.0), (1.0, 1e-1)):
        nxt = {}
        for name, t in state.items():
            f = t.float()
            mask = torch.rand(f.shape, generator=g) < density
            f = f + mask * scale * (f.abs() + 1e-3) * torch.randn(f.shape, generator=g)
            nxt[name] = f.to(t.dtype)
        yield nxt
        state = nxt


def _exercise(dtype: torch.dtype) -> None:
    """One keyframe and a chain of deltas of a small model, encoded, staged and applied; bit-exact."""
    old = _model(dtype, seed=0)
    chunks = encode_state_keyframe(old, chunk_bytes=16384)
    held = load_keyframe([c.data for c in chunks], hashes=[c.hash for c in chunks])
    for new in _steps(old, seed=1):
        for chunk in encode_state_delta(old, new, chunk_bytes=16384):
            apply_chunk_(held, chunk.data, expected_hash=chunk.hash)
        old = new
    for name, t in old.items():
        if not torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)):
            raise WeightSyncError(f"codec warm-up: {name} ({dtype}) did not round-trip bit-exactly")
    _parse_headers(dtype)


def _parse_headers(dtype: torch.dtype) -> None:
    """The header parsers a GPU worker's decoder calls from Python (:mod:`.device`), on a real payload."""
    fmt = _FLOATS[dtype]
    old = _model(dtype, seed=2)["mlp"].reshape(-1)
    new = next(iter(_steps({"mlp": old}, seed=3)))["mlp"]
    blob = encode_sparse(np_bits(old), np_bits(new), fmt)
    if blob is None:
        raise WeightSyncError("codec warm-up: the step changed nothing")
    buf = np.frombuffer(blob, dtype=np.uint8)
    thr, _, n_v, at, _ = _kernels.parse_head(buf, 0, len(buf), old.numel(), fmt.exp_count)
    bounds = (thr << fmt.mant).astype(np_bits(old).dtype)
    sizes = _kernels.class_counts(np_bits(old), np_bits(old).dtype.type(fmt.mag_mask), bounds)
    lengths, ones, params, tail_k, at, _ = _kernels.parse_sequences(buf, at, len(buf), sizes, n_v, LEVELS)
    _kernels.parse_streams(buf, at, len(buf), int(n_v.sum()), len(sizes), lengths, ones, params, tail_k, LEVELS)


def warm_kernels(dtypes: Iterable[torch.dtype] = DTYPES) -> float:
    """Compile (or load from the cache) every kernel for ``dtypes``; returns the seconds it took. Once per
    process and dtype: later calls return at once; dtypes the codec has no float kernels for (integer
    buffers) are skipped. Thread-safe (publishers and syncs warm from threads)."""
    started = time.perf_counter()
    with _lock:
        for dtype in dtypes:
            if dtype in DTYPES and dtype not in _warmed:
                _exercise(dtype)
                _warmed.add(dtype)
    return time.perf_counter() - started


def cache_location() -> str:
    """Where this process's numba writes and reads the kernels' cache (see the module docstring)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    in_tree = Path(__file__).parent / "__pycache__"
    if os.access(in_tree if in_tree.exists() else in_tree.parent, os.W_OK):
        return str(in_tree)
    from numba.misc.appdirs import user_cache_dir

    return user_cache_dir("numba")
