"""``rlbus bench llm``: a real LLM (SmolLM2-135M-Instruct) through engine → GRPO step → delta → worker apply.

One loop per learning rate (1e-6 and 3e-6; ``--quick``: 3e-6 only, fewer and smaller steps), each step
the whole path a distributed run takes, on the real model and real rollouts:

1. the rollout engine (`TorchEngine`, bf16 copy, KV cache) samples G completions of each of P two-digit
   sums, rendered with the model's own chat template and stopped on its end-of-turn token;
2. a verifier scores them (exact match of ``<answer>…</answer>``, else graded by the distance of the
   reply's last number, so the untrained model's groups differ) and `grpo_step` trains the fp32 master
   on the groups (chunked log-probs, bf16 autocast), reporting KL(engine ‖ trainer);
3. the `WeightPublisher` casts the master to bf16 and delta-encodes it against the previous version; a
   `WeightSync` worker applies the delta to the engine's weights and checks the digest (bit-exact);
4. the same delta is sized with the peers' formats — XOR + zstd-3 and int32 indices + bf16 values +
   zstd-3 (`rlbus_tools.bench.codec.peers`) — on identical bytes.

Same-run baselines: transformers' own ``generate`` on the same prompts (sampling, KV cache, same dtype)
for generation throughput, and the peer delta formats for the delta size. Reported under ``summary``:
``gen_tokens_per_s``, ``train_tokens_per_s``, ``delta_pct_of_full``, ``peer_delta_pct``, ``bit_exact``,
``kl_engine_trainer``, ``peak_rss_gb``.
"""

from __future__ import annotations

import asyncio
import re
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbus.engines.base import GenerationRequest, GenerationResult
from rlbus.engines.torch_engine import TorchEngine
from rlbus.engines.torch_stack import torch_stack
from rlbus.envs.chat import Answer
from rlbus.envs.tasks import generate_prompts
from rlbus.models.base import weight_tensors
from rlbus.models.hf_source import HFSource
from rlbus.models.sources import ModelSource
from rlbus.schemas import Prompt
from rlbus.training.batch import Group, sample_from_generation
from rlbus.training.config import GRPOConfig, OptimConfig
from rlbus.training.step import build_optimizer, grpo_step
from rlbus_tools.bench.codec import peers
from rlbus_tools.bench.common import Device, JsonPath, Quick, meta, print_table, synchronize, write_json

SYSTEM = "Give the final answer as <answer>ANSWER</answer>, for example <answer>42</answer>."


@dataclass(frozen=True)
class Setup:
    lrs: tuple[float, ...]
    steps: int
    prompts: int
    group_size: int
    max_new_tokens: int


FULL = Setup(lrs=(1e-6, 3e-6), steps=4, prompts=8, group_size=4, max_new_tokens=48)
QUICK = Setup(lrs=(3e-6,), steps=2, prompts=4, group_size=4, max_new_tokens=32)


def _requests(source: ModelSource, prompts: list[Prompt], setup: Setup, seed: int) -> list[GenerationRequest]:
    chat = source.chat
    out = []
    for i, p in enumerate(prompts):
        ids, _ = chat.render_messages([{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.text}])
        ids += chat.model_header
        for g in range(setup.group_size):
            out.append(GenerationRequest(
                prompt_ids=tuple(ids), max_new_tokens=setup.max_new_tokens, temperature=1.0,
                stop_token_ids=chat.stop_ids, seed=seed * 100_000 + i * 100 + g, request_id=f"{p.prompt_id}/{g}",
            ))
    return out


def _reward(source: ModelSource, result: GenerationResult, prompt: Prompt) -> float:
    """1 for the exact answer in the format; otherwise graded by how far the reply's last number is off
    (0.5 / (1 + |error|)), 0 without a number. The untrained model never uses the format, and an
    exact-match reward would give every group the same score — zero advantages, zero gradient, empty
    deltas; the graded score makes every step a real update."""
    action = source.chat.parse(result.text)
    expected = int(prompt.reference or 0)
    if isinstance(action, Answer) and action.text.strip() == str(expected):
        return 1.0
    numbers = re.findall(r"-?\d+", result.text)
    return 0.5 / (1 + abs(int(numbers[-1]) - expected)) if numbers else 0.0


def _bits(state: dict[str, torch.Tensor]) -> np.ndarray:
    """Every tensor's bf16 bits, in name order, as one flat uint16 array (what the peers encode)."""
    flat = torch.cat([state[k].reshape(-1) for k in sorted(state)]).view(torch.int16)
    return flat.cpu().numpy().view(np.uint16)


def hf_generate_baseline(engine: TorchEngine, requests: list[GenerationRequest]) -> float:
    """Tokens/s of transformers' own sampling ``generate`` on the same left-padded prompts (same weights)."""
    hf = engine.model.hf  # type: ignore[attr-defined]
    P = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), P), engine.pad_id, dtype=torch.long, device=engine.model.device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, P - len(r.prompt_ids):] = 1
    stops = list(requests[0].stop_token_ids)
    torch.manual_seed(0)
    synchronize(ids.device)
    started = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=requests[0].max_new_tokens, eos_token_id=stops, pad_token_id=engine.pad_id)
    synchronize(ids.device)
    seconds = time.perf_counter() - started
    new = out[:, P:]
    tokens = 0
    for row in new.tolist():
        n = len(row)
        for j, t in enumerate(row):
            if t in stops:
                n = j + 1
                break
        tokens += n
    return tokens / seconds


async def _run_lr(source: ModelSource, lr: float, setup: Setup, seed: int, log: Any) -> dict[str, Any]:
    from rlbus.blobs.local import LocalStore
    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.topics import topic_specs
    from rlbus.weights.publish import WeightPublisher
    from rlbus.weights.sync import WeightSync, bind_module, live_state

    torch.manual_seed(seed)
    master = source.build(torch.float32)
    stack = torch_stack(source, seed=seed)
    served, engine = stack.weights, stack.engine
    optimizer = build_optimizer(master, OptimConfig(lr=lr))
    grpo = GRPOConfig(compute_dtype="bfloat16", max_staleness=1, normalize_std=False, pad_id=source.pad_id)
    bus = MemoryBus(topic_specs())
    await bus.start()
    steps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-llm-") as tmp:
        store = LocalStore(Path(tmp))
        publisher = WeightPublisher(bus=bus, store=store, model_id="smollm2")
        sync = WeightSync(bus=bus, store=store, state=live_state(served), bind=bind_module(served),
                          swap=engine.swap_point.apply, model_id="smollm2", worker_id="bench")
        first = await publisher.publish(weight_tensors(master), version=1)  # keyframe: what the worker starts from
        await sync.handle(first)
        engine.policy_version = 1
        previous = {k: v.detach().to(torch.bfloat16).clone() for k, v in weight_tensors(master).items()}
        for step in range(setup.steps):
            prompts = generate_prompts("arith", seed=seed * 1000 + step, n=setup.prompts, config={"digits": 2})
            requests = _requests(source, prompts, setup, seed + step)
            t0 = time.perf_counter()
            results = await asyncio.to_thread(engine.generate, requests)
            gen_s = time.perf_counter() - t0
            gen_tokens = sum(len(r.token_ids) for r in results)
            rewards = [_reward(source, r, prompts[i // setup.group_size]) for i, r in enumerate(results)]
            groups = [
                Group(samples=tuple(sample_from_generation(r) for r in results[i:i + setup.group_size]),
                      rewards=torch.tensor(rewards[i:i + setup.group_size]))
                for i in range(0, len(results), setup.group_size)
            ]
            t0 = time.perf_counter()
            metrics = await asyncio.to_thread(grpo_step, master, optimizer, groups, config=grpo, version=1 + step)
            train_s = time.perf_counter() - t0
            manifest = await publisher.publish(weight_tensors(master), version=2 + step)
            applied = await sync.handle(manifest)
            engine.policy_version = 2 + step
            current = {k: v.detach().to(torch.bfloat16).clone() for k, v in weight_tensors(master).items()}
            bit_exact = applied and sync.digest == manifest.model_digest and all(
                torch.equal(served.state_dict()[k], current[k]) for k in current
            )
            stats = publisher.history[-1]
            peer = peers(_bits(previous), _bits(current))
            previous = current
            row = {
                "lr": lr, "step": step + 1, "reward_mean": sum(rewards) / len(rewards),
                "gen_tokens": gen_tokens, "gen_tokens_per_s": gen_tokens / gen_s,
                "train_tokens": metrics.tokens + sum(len(r.prompt_ids) for r in results),
                "train_s": train_s, "kl_engine_trainer": metrics.kl_k3,
                "max_abs_dlogprob": metrics.max_abs_dlogprob,
                "full_bytes": stats.full_bytes, "delta_bytes": stats.delta_bytes,
                "delta_pct_of_full": 100 * stats.delta_bytes / stats.full_bytes,
                "xor_zstd3_pct": 100 * int(peer["xor_zstd3"]) / stats.full_bytes,
                "indices_values_zstd3_pct": 100 * int(peer["indices_values_zstd3"]) / stats.full_bytes,
                "bit_exact": bool(bit_exact),
            }
            row["train_tokens_per_s"] = row["train_tokens"] / train_s
            row["peer_delta_pct"] = min(row["xor_zstd3_pct"], row["indices_values_zstd3_pct"])
            log(f"lr {lr:g} step {step + 1}/{setup.steps}: reward {row['reward_mean']:.2f}, "
                f"{row['gen_tokens_per_s']:.0f} gen tok/s, train {train_s:.1f} s, "
                f"delta {row['delta_pct_of_full']:.2f} % (peers {row['peer_delta_pct']:.2f} %), bit-exact {bit_exact}")
            steps.append(row)
        baseline = await asyncio.to_thread(hf_generate_baseline, engine, requests)
    await bus.close()
    return {"steps": steps, "hf_generate_tokens_per_s": baseline}


def run(quick: bool = False, json_path: Path | None = None, seed: int = 0, log: Any = print,
        device: str = "auto") -> dict[str, Any]:
    from rlbus.models.device import announce
    from rlbus.models.sources import model_dir

    setup = QUICK if quick else FULL
    where = announce(device, say=log)
    source = HFSource(model_dir(name="smollm2-135m-instruct", progress=log), device=where.device)
    per_lr = {f"{lr:g}": asyncio.run(_run_lr(source, lr, setup, seed, log)) for lr in setup.lrs}
    rows = [r for result in per_lr.values() for r in result["steps"]]

    def mean(key: str, lr: str | None = None) -> float:
        values = [r[key] for r in rows if lr is None or f"{r['lr']:g}" == lr]
        return float(sum(values) / len(values))

    def steady(key: str, lr: str) -> float:
        values = [r[key] for r in rows if f"{r['lr']:g}" == lr and r["step"] > 1] or [r[key] for r in rows]
        return float(sum(values) / len(values))

    summary: dict[str, Any] = {
        "gen_tokens_per_s": mean("gen_tokens_per_s"),
        "hf_generate_tokens_per_s": float(np.mean([r["hf_generate_tokens_per_s"] for r in per_lr.values()])),
        "train_tokens_per_s": mean("train_tokens_per_s"),
        "delta_pct_of_full": {lr: mean("delta_pct_of_full", lr) for lr in per_lr},
        "peer_delta_pct": {lr: mean("peer_delta_pct", lr) for lr in per_lr},
        # Adam's first update moves nearly every weight by ≈ lr (m/√v = ±1), so version 2 is the largest delta;
        # the later ones are what a long run ships
        "delta_pct_after_first": {lr: steady("delta_pct_of_full", lr) for lr in per_lr},
        "peer_delta_pct_after_first": {lr: steady("peer_delta_pct", lr) for lr in per_lr},
        "bit_exact": all(r["bit_exact"] for r in rows),
        "kl_engine_trainer": mean("kl_engine_trainer"),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    result = {"meta": meta(), "setup": setup.__dict__, "model": "smollm2-135m-instruct", "device": where.as_dict(),
              "steps": rows, "summary": summary}
    print_table(
        "rlbus bench llm — SmolLM2-135M-Instruct, engine → GRPO → delta → worker (per step)",
        ["lr / step", "reward", "gen tok/s", "train tok/s", "KL", "delta %", "xor+zstd %", "idx+val %", "exact"],
        [[f"{r['lr']:g} / {r['step']}", r["reward_mean"], r["gen_tokens_per_s"], r["train_tokens_per_s"],
          f"{r['kl_engine_trainer']:.1e}", r["delta_pct_of_full"], r["xor_zstd3_pct"], r["indices_values_zstd3_pct"],
          r["bit_exact"]] for r in rows],
    )
    print_table("summary (baseline: transformers generate, peer delta formats)", ["figure", "value"], [
        ["engine gen tok/s", summary["gen_tokens_per_s"]],
        ["transformers generate tok/s", summary["hf_generate_tokens_per_s"]],
        ["train tok/s", summary["train_tokens_per_s"]],
        *[[f"delta % of full bf16 (lr {lr})", v] for lr, v in summary["delta_pct_of_full"].items()],
        *[[f"best peer % (lr {lr})", v] for lr, v in summary["peer_delta_pct"].items()],
        *[[f"delta % / best peer % after the first step (lr {lr})",
           f"{v:.2f} / {summary['peer_delta_pct_after_first'][lr]:.2f}"]
          for lr, v in summary["delta_pct_after_first"].items()],
        ["bit-exact", summary["bit_exact"]], ["KL engine‖trainer", f"{summary['kl_engine_trainer']:.2e}"],
        ["peak RSS GB", summary["peak_rss_gb"]],
    ])
    write_json(json_path, result)
    return result


def main(json_path: JsonPath = None, quick: Quick = False, device: Device = "auto") -> None:
    """SmolLM2 through the whole loop: engine, trainer, codec on real deltas."""
    run(quick=quick, json_path=json_path, device=device)
