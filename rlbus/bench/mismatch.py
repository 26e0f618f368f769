"""``rlbus bench mismatch``: how far the trainer's log-probs drift from the engine's, and what router replay
does about it.

The engine (`TorchEngine`) generates with the bf16 cast of the weights, left-padded batches of
``engine_batch`` prompts and KV-cache incremental decoding. The trainer then re-scores exactly the same
tokens with one full-sequence forward over right-padded batches of ``trainer_batch`` rows — different
shapes, different kernels, different padding — in four ways: bf16 weights (the same bits the engine
holds), the trainer's bf16 autocast mode (amp), or the fp32 master weights, each with and without router
replay. Per case, over every generated token: KL(engine ‖ trainer) by k3, max |Δ log-prob| and two
router-flip rates (the experts the trainer used, and its router's own top-k, against the engine's
record; see `measure`). Sampling is at temperature 1 with
no top-k/top-p, so the engine's "processed" log-probs are the plain model distribution and the two sides
compare like with like. Summary: ``replay_kl_reduction`` = KL without replay / KL with replay, the
smallest (worst) ratio over the trainer variants.

Why the model is trained first. A randomly initialised MoE is a poor stand-in: its output distribution is
nearly uniform (so any routing difference barely moves a log-prob) and its experts are interchangeable
(tiny, similar outputs), so a flip costs nothing and replay has nothing to fix. The benchmark therefore
trains the policy briefly on a synthetic, seeded corpus (word sentences and sums, byte-tokenized) with
`rlbus.training.sft.pretrain`: next-token distributions become peaked, experts specialise and the router
logits spread out, as in a real model. Router weights are not rescaled by hand — training sets their
scale, so the flip rate is whatever the numerics produce.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlbus.bench.common import meta, print_table, write_json
from rlbus.engines.base import GenerationRequest
from rlbus.engines.torch_engine import TorchEngine
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import BOS_ID
from rlbus.rl.metrics import kl_k3, max_abs_logprob_diff, router_flip_rate
from rlbus.training.batch import pack, sample_from_generation
from rlbus.training.sft import SFTExample, pretrain
from rlbus.training.step import score

WORDS = (
    "the a one cat dog bird fish fox owl sees eats likes chases runs sleeps to from with under over big small "
    "red blue green quick slow old young happy"
).split()


@dataclass(frozen=True)
class Setup:
    """Sizes of one run (full or quick)."""

    d_model: int
    train_steps: int
    prompts: int
    new_tokens: int
    engine_batch: int = 4
    trainer_batch: int = 6


FULL = Setup(d_model=256, train_steps=40, prompts=48, new_tokens=64)
QUICK = Setup(d_model=128, train_steps=25, prompts=16, new_tokens=32)


def model_config(d_model: int) -> PolicyConfig:
    """4 layers, 16 experts top-2: the shape of the H200 reference, at a CPU-friendly width."""
    return PolicyConfig(
        vocab=272, d_model=d_model, n_layer=4, n_head=8, max_seq=160, n_experts=16, top_k=2, d_ff=d_model
    )


def corpus(n: int, seed: int) -> list[str]:
    """Seeded synthetic text: a few words in random order, then a sum with its answer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 10)))
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"{words}. {a}+{b}={a + b}.")
    return lines


def train(setup: Setup, seed: int = 0) -> Policy:
    """The fp32 master model after a brief warm-up on `corpus` (see the module docstring for why)."""
    torch.manual_seed(seed)
    model = Policy(model_config(setup.d_model))
    examples = [SFTExample.from_completion((BOS_ID,), tuple(line.encode())) for line in corpus(512, seed)]
    pretrain(model, examples, setup.train_steps, 3e-3, 16, seed)
    return model.eval()


TRAINERS: tuple[tuple[str, Literal["float32", "bfloat16"]], ...] = (
    ("bf16", "float32"),
    ("amp", "bfloat16"),
    ("fp32", "float32"),
)
"""(case name, compute dtype): ``bf16`` scores with the engine's own bf16 weights; ``amp`` is the
trainer's ``compute_dtype="bfloat16"`` mode (bf16 matmuls over the fp32 master weights, fp32 residual
stream and norms); ``fp32`` is the fp32 master model."""


def measure(master: Policy, setup: Setup, seed: int = 1) -> list[dict[str, Any]]:
    """Generate with the bf16 engine, then re-score every way in `TRAINERS`, with and without replay.

    Two flip rates per case: ``router_flip_rate`` compares the experts the trainer's forward actually
    used (its own top-k, or the replayed ids) with the engine's record taken straight from the
    `GenerationResult`s — so under replay it also checks that packing aligns the replayed experts with
    the right tokens; ``router_own_flip_rate`` is the trainer router's own top-k against the engine's,
    the number the GRPO step reports.
    """
    engine_model = copy.deepcopy(master).to(torch.bfloat16)
    engine = TorchEngine(engine_model, seed=seed)
    prompts = [(BOS_ID, *line.encode()[: 8 + i % 9]) for i, line in enumerate(corpus(setup.prompts, seed + 1))]
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=setup.new_tokens, temperature=1.0) for p in prompts]
    results = []
    for i in range(0, len(requests), setup.engine_batch):
        results += engine.generate(requests[i : i + setup.engine_batch])
    samples = [sample_from_generation(r) for r in results]
    engine_lp = torch.cat([r.logprobs for r in results])  # [N] every generated token
    recorded = torch.cat(  # [L, N, k] engine experts at the input position of every generated token
        [r.routed_experts[:, len(r.prompt_ids) - 1 :] for r in results if r.routed_experts is not None], dim=1
    ).long()

    cases = []
    for name, dtype in TRAINERS:
        trainer = engine_model if name == "bf16" else master
        for replay in (False, True):
            trainer_lp, own, used = [], [], []
            for i in range(0, len(samples), setup.trainer_batch):
                chunk = samples[i : i + setup.trainer_batch]
                batch = pack(chunk, torch.zeros(len(chunk)))
                logp, experts = score(trainer, batch, replay=replay, dtype=dtype)  # [B, S], [L, B, S, k]
                if experts is None or batch.routed_experts is None:
                    raise RuntimeError("the benchmark model is an MoE: routing must be reported")
                mask = batch.loss_mask  # [B, S]
                trainer_lp.append(logp[mask])
                own.append(experts[:, mask])
                used.append(batch.routed_experts[:, mask] if replay else experts[:, mask])
            t = torch.cat(trainer_lp)  # [N]
            everywhere = torch.ones_like(t, dtype=torch.bool)  # [N]
            as_batch = (everywhere[None], recorded[:, None])  # mask [1, N], experts [L, 1, N, k]
            cases.append(
                {
                    "name": f"{name}{' + replay' if replay else ''}",
                    "trainer": name,
                    "replay": replay,
                    "kl": kl_k3(engine_lp, t, everywhere),
                    "max_abs_dlogprob": max_abs_logprob_diff(t, engine_lp, everywhere),
                    "router_flip_rate": router_flip_rate(torch.cat(used, 1)[:, None], as_batch[1], as_batch[0]),
                    "router_own_flip_rate": router_flip_rate(torch.cat(own, 1)[:, None], as_batch[1], as_batch[0]),
                    "tokens": int(t.numel()),
                }
            )
    return cases


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """KL reduction by replay per trainer variant, and the worst of them (bf16, amp and fp32)."""
    by = {(c["trainer"], c["replay"]): c for c in cases}
    reductions = {}
    for name, _ in TRAINERS:
        with_replay = by[(name, True)]["kl"]
        reductions[name] = by[(name, False)]["kl"] / with_replay if with_replay > 0 else float("inf")
    return {
        "replay_kl_reduction": min(reductions.values()),
        "replay_kl_reduction_by_trainer": reductions,
        "replay_flip_rate_max": max(c["router_flip_rate"] for c in cases if c["replay"]),
    }


def json_meta() -> dict[str, Any]:
    """`meta()` made JSON-encodable: ``torch.__version__`` is a str subclass msgspec refuses to encode.
    (Belongs in `rlbus.bench.common.meta`; shared with `rlbus.bench.train` until it moves there.)"""
    info = meta()
    if info.get("torch") is not None:
        info["torch"] = str(info["torch"])
    return info


def run(quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    t0 = time.perf_counter()
    master = train(setup)
    t1 = time.perf_counter()
    cases = measure(master, setup)
    t2 = time.perf_counter()
    summary = summarize(cases)
    cfg = master.config
    print_table(
        f"trainer vs bf16 engine, MoE {cfg.n_layer}L {cfg.n_experts}E top-{cfg.top_k} d{cfg.d_model}",
        ["case", "KL k3", "max|Δlp|", "flips used", "flips own", "tokens"],
        [
            [
                c["name"],
                f"{c['kl']:.3e}",
                f"{c['max_abs_dlogprob']:.4f}",
                f"{c['router_flip_rate']:.4f}",
                f"{c['router_own_flip_rate']:.4f}",
                c["tokens"],
            ]
            for c in cases
        ],
    )
    ratios = ", ".join(f"{k} {v:.1f}×" for k, v in summary["replay_kl_reduction_by_trainer"].items())
    print(
        f"KL reduction by router replay: {ratios} (worst {summary['replay_kl_reduction']:.1f}×); "
        f"flip rate of the experts used under replay: {summary['replay_flip_rate_max']}"
    )
    result = {
        "benchmark": "mismatch",
        "quick": quick,
        "meta": json_meta(),
        "model": {
            "d_model": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_experts": cfg.n_experts,
            "top_k": cfg.top_k,
            "params": master.num_params(),
            "warmup_steps": setup.train_steps,
        },
        "setup": {
            "prompts": setup.prompts,
            "new_tokens": setup.new_tokens,
            "engine_batch": setup.engine_batch,
            "trainer_batch": setup.trainer_batch,
            "engine_dtype": "bf16",
            "temperature": 1.0,
        },
        "cases": cases,
        "summary": summary,
        "seconds": {"warmup": t1 - t0, "measure": t2 - t1},
    }
    write_json(json_path, result)
    return result
