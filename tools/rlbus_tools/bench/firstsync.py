"""``rlbus bench firstsync``: the first weight sync of a fresh process, with a cold and a warm kernel cache.

The codec's kernels are compiled by numba on first use and cached on disk (`rlbus.weights.codec.warm`). Each
row runs in a new process with its own ``NUMBA_CACHE_DIR`` and times, on the demo's policy (bf16, an
Adam-sized update of every weight): the start-up warm-up (none in the first row), then the first delta's
encode (the trainer's side) and stage (decode and apply, a rollout worker's side).

    cold, no warm-up     an empty cache, kernels compiled inside the first sync (what the first run paid)
    cold, warmed         an empty cache, `warm_kernels` at start-up (what a process does before ready)
    warm cache           the cache the row above filled (every later process; the baseline)

The target: the cold first sync (after the start-up warm-up) within 2× the warm one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json

ROWS = (("cold, no warm-up", False, True), ("cold, warmed", True, True), ("warm cache", True, False))


def _child(warm: bool) -> dict[str, float]:
    import torch

    from rlbus.models.policy import Policy, PolicyConfig
    from rlbus.weights.codec import apply_chunk_, encode_state_delta
    from rlbus.weights.codec.warm import warm_kernels

    warm_s = warm_kernels([torch.bfloat16]) if warm else 0.0
    torch.manual_seed(0)
    master = Policy(PolicyConfig()).state_dict()
    old = {k: v.detach().to(torch.bfloat16) for k, v in master.items() if v.is_floating_point()}
    g = torch.Generator().manual_seed(1)
    new = {k: (v.float() - 1e-3 * torch.sign(torch.randn(v.shape, generator=g))).to(torch.bfloat16)
           for k, v in old.items()}
    held = {k: v.clone() for k, v in old.items()}
    t0 = time.perf_counter()
    chunks = encode_state_delta(old, new)
    t1 = time.perf_counter()
    for chunk in chunks:
        apply_chunk_(held, chunk.data, expected_hash=chunk.hash)
    t2 = time.perf_counter()
    exact = all(torch.equal(held[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    return {"warm_up_s": warm_s, "encode_s": t1 - t0, "stage_s": t2 - t1, "first_sync_s": t2 - t0,
            "bytes": sum(c.size for c in chunks), "bit_exact": exact}


def run(*, quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-numba-") as cache:
        for label, warm, empty in ROWS:
            if empty:
                shutil.rmtree(cache)
                Path(cache).mkdir()
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            out = subprocess.run([sys.executable, "-m", "rlbus_tools.bench.firstsync", "--child", str(int(warm))],
                                 env=env, capture_output=True, text=True, check=True, timeout=900)
            rows.append({"row": label, **json.loads(out.stdout.strip().splitlines()[-1])})
    by = {r["row"]: r for r in rows}
    ratio = by["cold, warmed"]["first_sync_s"] / by["warm cache"]["first_sync_s"]
    summary = {"cold_over_warm_first_sync": ratio, "target": 2.0, "met": ratio <= 2.0,
               "before_over_warm_first_sync": by["cold, no warm-up"]["first_sync_s"] / by["warm cache"]["first_sync_s"]}
    print_table("first weight sync of a fresh process (demo policy, bf16)",
                ["", "warm-up s", "encode s", "stage s", "first sync s", "bit-exact"],
                [[r["row"], r["warm_up_s"], r["encode_s"], r["stage_s"], r["first_sync_s"], r["bit_exact"]]
                 for r in rows])
    print(f"cold (warmed) / warm first sync: {ratio:.2f}× (target ≤ 2×); without the warm-up "
          f"{summary['before_over_warm_first_sync']:.1f}×")
    result = {"meta": meta(), "rows": rows, "summary": summary}
    write_json(json_path, result)
    return result


if __name__ == "__main__":  # the child process of one row
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(sys.argv[2] == "1")))


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """A cold worker's first sync: compiled-kernel cache warm or empty."""
    run(quick=quick, json_path=json_path)
