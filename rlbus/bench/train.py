"""``rlbus bench train``: GRPO trainer throughput — steps/s and tokens/s of `grpo_step` on this machine.

Two model sizes: ~11M parameters (6 layers, d_model 256, 8 experts top-2) and the ~95M benchmark
policy (`PolicyConfig.bench()`: 8 layers, d_model 768, 8 experts top-2, ~38M active per token). Each step
is the whole update: one padded forward over the batch, the IS correction, the clipped loss, backward,
gradient clipping and AdamW on the fp32 master weights.

Same-run baseline: every size runs twice on identical batches, without and with router replay (the
engine's recorded experts fed to the forward). Replay swaps the trainer's own top-k for given ids, so it
should cost nothing; the table shows whether it does.

The batches are synthetic — random token ids, rewards, behaviour log-probs and recorded experts, seeded —
because throughput depends only on shapes: ``groups × group_size`` sequences of ``prompt + completion``
tokens, the completion trained. The first step of each mode is a warm-up and is not timed. ``--quick``
runs only the small model, with fewer and shorter steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbus.bench.common import print_table, write_json
from rlbus.bench.mismatch import json_meta
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.training.batch import Group, Sample
from rlbus.training.step import GRPOConfig, OptimConfig, build_optimizer, grpo_step


@dataclass(frozen=True)
class Size:
    """One row pair of the table: a model and the batch it trains on."""

    name: str
    config: PolicyConfig
    groups: int
    group_size: int
    prompt: int
    completion: int
    steps: int
    """Timed steps per mode (after one warm-up step)."""


def small_config() -> PolicyConfig:
    """~11M parameters: the CPU-sized training model."""
    return PolicyConfig(vocab=272, d_model=256, n_layer=6, n_head=8, max_seq=512, n_experts=8, top_k=2, d_ff=256)


FULL = (
    Size("~11M", small_config(), groups=4, group_size=4, prompt=32, completion=96, steps=4),
    Size("~95M", PolicyConfig.bench(), groups=4, group_size=4, prompt=32, completion=96, steps=2),
)
QUICK = (Size("~11M", small_config(), groups=2, group_size=4, prompt=16, completion=48, steps=2),)


def synthetic_groups(size: Size, seed: int) -> list[Group]:
    """Seeded random groups with the shapes of ``size`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    cfg = size.config
    T = size.prompt + size.completion
    groups = []
    for _ in range(size.groups):
        samples = []
        for _ in range(size.group_size):
            mask = torch.arange(T) >= size.prompt  # [T] the completion is trained
            samples.append(
                Sample(
                    token_ids=torch.randint(0, 256, (T,), generator=g),
                    loss_mask=mask,
                    logprobs=torch.where(mask, -5.6 + 0.1 * torch.randn(T, generator=g), 0.0),  # ≈ log(1/272)
                    versions=torch.where(mask, 0, -1),
                    routed_experts=torch.rand(cfg.n_layer, T, cfg.n_experts, generator=g).argsort(-1)[..., : cfg.top_k],
                )
            )
        groups.append(Group(samples=tuple(samples), rewards=torch.rand(size.group_size, generator=g).round()))
    return groups


def measure(size: Size, *, replay: bool, seed: int = 0) -> dict[str, Any]:
    """Time ``size.steps`` GRPO steps (after a warm-up) of a fresh model; returns one table row's figures."""
    torch.manual_seed(seed)
    model = Policy(size.config)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-5))
    config = GRPOConfig(router_replay=replay, normalize_std=False)
    batches = [synthetic_groups(size, seed + i) for i in range(size.steps + 1)]
    grpo_step(model, optimizer, batches[0], config=config, version=0)
    started = time.perf_counter()
    trained = 0
    for groups in batches[1:]:
        trained += grpo_step(model, optimizer, groups, config=config, version=0).tokens
    elapsed = time.perf_counter() - started
    sequences = size.groups * size.group_size
    processed = size.steps * sequences * (size.prompt + size.completion - 1)
    return {
        "model": size.name,
        "params": model.num_params(),
        "replay": replay,
        "steps": size.steps,
        "sequences_per_step": sequences,
        "tokens_per_sequence": size.prompt + size.completion,
        "seconds": elapsed,
        "steps_per_s": size.steps / elapsed,
        "tokens_per_s": processed / elapsed,
        "trained_tokens_per_s": trained / elapsed,
    }


def run(quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    rows = [measure(size, replay=replay) for size in (QUICK if quick else FULL) for replay in (False, True)]
    print_table(
        f"GRPO trainer step on CPU ({torch.get_num_threads()} threads), fp32",
        ["model", "replay", "params", "steps/s", "tokens/s", "trained tok/s"],
        [
            [
                r["model"],
                "yes" if r["replay"] else "no",
                f"{r['params'] / 1e6:.1f}M",
                f"{r['steps_per_s']:.3f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['trained_tokens_per_s']:,.0f}",
            ]
            for r in rows
        ],
    )
    result = {"benchmark": "train", "quick": quick, "meta": json_meta(), "rows": rows}
    write_json(json_path, result)
    return result
