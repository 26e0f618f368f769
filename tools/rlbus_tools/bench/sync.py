"""``rlbus bench sync``: a trainer publishes versions of a bf16 model; 3 workers follow over HTTP.

The trainer keeps fp32 master weights and takes real Adam steps (β = 0.9/0.999, lr 3e-6) on seeded
random-normal gradients, one tensor at a time; the Adam moments are stored in bf16 (the update itself
is computed in fp32) so trainer, publisher and three double-buffered workers fit in 24 GiB.
Each version is published through :class:`WeightPublisher` into an origin blob server on loopback;
three :class:`WeightSync` workers — each a torch module swapped double-buffered (the swap re-points
its parameters; see :mod:`rlbus.weights.sync`) — follow ``rl.weights.v1`` (in-memory bus, so the figures are the weight
path, not Kafka) and fetch through the signed HTTP client. After the run a late joiner catches up from
the newest keyframe. Baseline, same run: shipping the full bf16 snapshot to the three workers over the
same HTTP store.

Reported: bytes fetched per version vs full, publish latency, manifest → all workers swapped, swap
pause p50/p99, late-joiner catch-up time.
"""

from __future__ import annotations

import asyncio
import gc
import math
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from rlbus.blobs.http import BlobServer, HttpStore, serve
from rlbus.blobs.local import LocalStore
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.observe.stats import percentile
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync, bind_module, live_state
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json
from rlbus_tools.services import free_port


class AdamModel:
    """fp32 master weights of a transformer-shaped model and per-tensor Adam state."""

    def __init__(self, total_params: int, seed: int = 0, width: int = 2048) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.master: dict[str, torch.Tensor] = {}
        layers = max(1, total_params // (12 * width * width))
        for layer in range(layers):
            for name, shape in (("attn.qkv", (3 * width, width)), ("attn.out", (width, width)),
                                ("mlp.up", (4 * width, width)), ("mlp.down", (width, 4 * width))):
                std = 1 / math.sqrt(shape[1])
                self.master[f"layers_{layer}_{name.replace('.', '_')}"] = torch.randn(shape, generator=self.g) * std
            self.master[f"layers_{layer}_norm"] = 1 + 0.1 * torch.randn(width, generator=self.g)
        self.m = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in self.master.items()}
        self.v = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in self.master.items()}
        self.t = 0

    @property
    def bf16_bytes(self) -> int:
        return sum(t.numel() * 2 for t in self.master.values())

    def step(self, lr: float = 3e-6, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
        self.t += 1
        for name, w in self.master.items():
            grad = torch.randn(w.shape, generator=self.g)
            m = self.m[name].float().mul_(b1).add_(grad, alpha=1 - b1)
            v = self.v[name].float().mul_(b2).addcmul_(grad, grad, value=1 - b2)
            w.addcdiv_(m, (v / (1 - b2**self.t)).sqrt_().add_(eps), value=-lr / (1 - b1**self.t))
            self.m[name].copy_(m)
            self.v[name].copy_(v)


def _blank(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}


def _module(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """A worker's model: one bf16 parameter per tensor (what the engine would compute with)."""
    module = torch.nn.Module()
    for name, t in _blank(shapes).items():
        module.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return module


async def _run(quick: bool) -> dict[str, Any]:
    params, versions, workers_n = (25_000_000, 5, 3) if quick else (750_000_000, 20, 3)
    model = AdamModel(params, width=1024 if quick else 2048)
    secret = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-sync-") as tmp:
        port = free_port()
        runner = await serve(BlobServer(LocalStore(Path(tmp) / "origin"), secret=secret), "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        bus = MemoryBus(topic_specs())
        await bus.start()
        trainer_store = HttpStore(url, secret=secret)
        publisher = WeightPublisher(bus=bus, store=trainer_store, keyframe_every=10, retain_versions=versions + 1)
        shapes = {k: tuple(v.shape) for k, v in model.master.items()}
        stores = [HttpStore(url, secret=secret) for _ in range(workers_n)]
        modules = [_module(shapes) for _ in range(workers_n)]
        workers = [
            WeightSync(bus=bus, store=store, state=live_state(m), bind=bind_module(m))
            for store, m in zip(stores, modules, strict=True)
        ]
        stop = asyncio.Event()
        followers = [asyncio.create_task(w.run(stop)) for w in workers]
        await asyncio.sleep(0.2)

        # Baseline: full bf16 snapshot to every worker over the same store.
        # Chunks are uploaded and fetched a tensor at a time so the baseline never holds more than one
        # tensor's bytes per worker (the full model three times over would not fit beside the rest).
        t0 = time.perf_counter()
        keys = []
        for name, tensor in model.master.items():
            raw = tensor.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
            for i in range(0, len(raw), 4 << 20):
                keys.append(f"baseline/{name}/{i:012d}")
                await trainer_store.put(keys[-1], raw[i : i + (4 << 20)])
            del raw

        async def fetch_all(store: HttpStore) -> None:
            for key in keys:
                await store.get(key)

        await asyncio.gather(*(fetch_all(s) for s in stores))
        baseline_s = time.perf_counter() - t0

        rows: list[dict[str, Any]] = []
        for _ in range(versions):
            await asyncio.to_thread(model.step)
            fetched_before = [s.bytes_fetched for s in stores]
            manifest = await publisher.publish(model.master, version=publisher.version + 1)
            announced = time.perf_counter()
            while any(w.version != manifest.version for w in workers):  # noqa: ASYNC110 - polling a plain int
                await asyncio.sleep(0.002)
            all_swapped = time.perf_counter() - announced
            stats = publisher.history[-1]
            rows.append({
                "version": manifest.version,
                "kind": stats.kind,
                "delta_bytes": stats.delta_bytes,
                "bytes_fetched_per_worker": sum(s.bytes_fetched for s in stores) / workers_n
                - sum(fetched_before) / workers_n,
                "publish_s": stats.total_s,
                "manifest_to_all_swapped_s": all_swapped,
                "swap_pause_ms": [w.history[-1].swap_pause_s * 1000 for w in workers],
            })
        stop.set()
        await asyncio.gather(*followers)
        final_digest = workers[0].digest
        del workers, modules, followers  # make room for the late joiner's copy
        gc.collect()
        late_store = HttpStore(url, secret=secret)
        late = WeightSync(bus=bus, store=late_store, state=_blank(shapes))
        t0 = time.perf_counter()
        await late.catch_up()
        catch_up_s = time.perf_counter() - t0
        for s in [*stores, trainer_store, late_store]:
            await s.close()
        await runner.cleanup()

    deltas = [r for r in rows if r["version"] > 1]
    pauses = [p for r in deltas for p in r["swap_pause_ms"]]
    full = model.bf16_bytes
    return {
        "model_bf16_bytes": full,
        "versions": rows,
        "workers": workers_n,
        "summary": {
            "fetched_per_version_pct_of_full_mean": 100 * sum(r["bytes_fetched_per_worker"] for r in deltas)
            / len(deltas) / full,
            "publish_s_p50": percentile([r["publish_s"] for r in deltas], 50),
            "manifest_to_all_swapped_s_p50": percentile([r["manifest_to_all_swapped_s"] for r in deltas], 50),
            "manifest_to_all_swapped_s_max": max(r["manifest_to_all_swapped_s"] for r in deltas),
            "swap_pause_ms_p50": percentile(pauses, 50),
            "swap_pause_ms_p99": percentile(pauses, 99),
            "late_joiner_catch_up_s": catch_up_s,
            "baseline_full_broadcast_s": baseline_s,
            "late_joiner_bit_exact": late.digest == final_digest,
        },
    }


def run(quick: bool, json_path: Path | None) -> dict[str, Any]:
    result = asyncio.run(_run(quick))
    s = result["summary"]
    result["targets"] = {
        "swap_pause_ms<=50": s["swap_pause_ms_p99"] <= 50,
        "all_workers_swapped_s<=2": s["manifest_to_all_swapped_s_max"] <= 2,
    }
    result["meta"] = {**meta(), "quick": quick}
    print_table(
        f"rlbus bench sync — {result['model_bf16_bytes'] / 1e9:.2f} GB bf16, {result['workers']} workers over HTTP",
        ["measure", "value"],
        [
            ["fetched per version (% of full)", s["fetched_per_version_pct_of_full_mean"]],
            ["publish latency p50 (s)", s["publish_s_p50"]],
            ["manifest → all swapped p50 / max (s)",
             f"{s['manifest_to_all_swapped_s_p50']:.2f} / {s['manifest_to_all_swapped_s_max']:.2f}"],
            ["swap pause p50 / p99 (ms)", f"{s['swap_pause_ms_p50']:.1f} / {s['swap_pause_ms_p99']:.1f}"],
            ["late joiner catch-up (s)", s["late_joiner_catch_up_s"]],
            ["baseline: full bf16 to all workers (s)", s["baseline_full_broadcast_s"]],
        ],
    )
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """Weight sync end to end: publish to every worker swapped, the swap pause."""
    run(quick=quick, json_path=json_path)
