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

``--model hf-moe`` runs the same measurement on a ``transformers`` MoE instead: a randomly initialised
Qwen3-MoE of the same shape (`hf_moe_config`, no warm-up), whose routers `rlbus.models.hf_moe.RouterTap`
records in the engine and replays in the trainer. The engine is its bf16 copy; the trainer is the fp32
master scoring through `HFCausalLM.features` and the LM head, with and without replay (cases ``fp32`` and
``fp32 + replay``). Its figures are a random model's (see above for what that leaves out); what holds at any
size is that replay through the hooks runs the engine's experts token for token (flip rate 0).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import typer

from rlbus.engines.base import GenerationRequest
from rlbus.engines.kinds import EngineKind, engine_kind
from rlbus.engines.torch_engine import TorchEngine
from rlbus.engines.torch_stack import inference_copy
from rlbus.errors import ConfigError
from rlbus.models.hf import HFCausalLM
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import BOS_ID
from rlbus.rl.logprobs import sampled_token_logprobs
from rlbus.rl.metrics import kl_k3, max_abs_logprob_diff, router_flip_rate
from rlbus.training.batch import PackedBatch, Sample, pack, sample_from_generation
from rlbus.training.sft import SFTExample, pretrain
from rlbus.training.step import score
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json

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


def hf_moe_config(d_model: int) -> Any:
    """A ``transformers`` Qwen3-MoE of the same shape: 4 layers, 16 experts top-2 (renormalised), 8 heads
    (4 key/value), the byte vocabulary, untied LM head."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=272, hidden_size=d_model, intermediate_size=2 * d_model, moe_intermediate_size=d_model,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=160, tie_word_embeddings=False,
    )  # fmt: skip


def random_hf_moe(setup: Setup, seed: int = 0) -> HFCausalLM:
    """The fp32 master for ``--model hf-moe``: randomly initialised from `hf_moe_config`, not warmed up."""
    return HFCausalLM.from_config(hf_moe_config(setup.d_model), seed=seed).eval()


TRAINERS: tuple[tuple[str, Literal["float32", "bfloat16"]], ...] = (
    ("bf16", "float32"),
    ("amp", "bfloat16"),
    ("fp32", "float32"),
)
"""(case name, compute dtype): ``bf16`` scores with the engine's own bf16 weights; ``amp`` is the
trainer's ``compute_dtype="bfloat16"`` mode (bf16 matmuls over the fp32 master weights, fp32 residual
stream and norms); ``fp32`` is the fp32 master model."""


def measure(master: Policy, setup: Setup, seed: int = 1, engine: EngineKind | None = None,
            device: str = "cpu") -> list[dict[str, Any]]:
    """Generate with the bf16 engine, then re-score every way in `TRAINERS`, with and without replay.

    Two flip rates per case: ``router_flip_rate`` compares the experts the trainer's forward actually
    used (its own top-k, or the replayed ids) with the engine's record taken straight from the
    `GenerationResult`s — so under replay it also checks that packing aligns the replayed experts with
    the right tokens; ``router_own_flip_rate`` is the trainer router's own top-k against the engine's,
    the number the GRPO step reports. ``engine`` serves the bf16 copy (default: the torch engine).
    """
    master = master.to(device)
    served = (engine or engine_kind("torch")).serve(master, seed=seed)
    engine_model = served.weights
    samples, engine_lp, recorded = generate(served.engine, setup, seed)
    cases = []
    for name, dtype in TRAINERS:
        trainer = engine_model if name == "bf16" else master
        for replay in (False, True):
            scored = rescore(samples, setup, partial(score, trainer, replay=replay, dtype=dtype), replay=replay,
                             device=device)
            cases.append(case(name, replay, engine_lp, recorded, *scored))
    return cases


def measure_hf(
    master: HFCausalLM, setup: Setup, seed: int = 1, engine: EngineKind | None = None, device: str = "cpu"
) -> list[dict[str, Any]]:
    """`measure` for an HF MoE: the bf16 engine copy generates, the fp32 master re-scores through the
    trainer's path (`HFCausalLM.features` and the LM head), with and without router replay."""
    master = master.to(device)
    served = (engine or engine_kind("torch")).serve(master, seed=seed)
    samples, engine_lp, recorded = generate(served.engine, setup, seed)
    cases = []
    for replay in (False, True):
        scored = rescore(samples, setup, partial(score_features, master, replay=replay), replay=replay,
                         device=device)
        cases.append(case("fp32", replay, engine_lp, recorded, *scored))
    return cases


def generate(
    engine: TorchEngine, setup: Setup, seed: int
) -> tuple[list[Sample], torch.Tensor, torch.Tensor]:
    """(samples, engine log-probs [N] of every generated token, engine experts [L, N, k] at the input
    position of every generated token) of `setup.prompts` seeded prompts, ``engine_batch`` at a time."""
    prompts = [(BOS_ID, *line.encode()[: 8 + i % 9]) for i, line in enumerate(corpus(setup.prompts, seed + 1))]
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=setup.new_tokens, temperature=1.0) for p in prompts]
    results = []
    for i in range(0, len(requests), setup.engine_batch):
        results += engine.generate(requests[i : i + setup.engine_batch])
    samples = [sample_from_generation(r) for r in results]
    engine_lp = torch.cat([r.logprobs for r in results])  # [N]
    recorded = torch.cat(  # [L, N, k]
        [r.routed_experts[:, len(r.prompt_ids) - 1 :] for r in results if r.routed_experts is not None], dim=1
    ).long()
    return samples, engine_lp, recorded


Scorer = Callable[[PackedBatch], tuple[torch.Tensor, torch.Tensor | None]]
"""A packed batch → (trainer log-probs [B, S], own top-k experts [L, B, S, k])."""


def rescore(
    samples: list[Sample], setup: Setup, scorer: Scorer, *, replay: bool, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer log-probs [N], experts used [L, N, k], own top-k [L, N, k]) at every generated token, scored
    ``trainer_batch`` right-padded rows at a time on ``device`` (the figures come back to the CPU)."""
    trainer_lp, own, used = [], [], []
    for i in range(0, len(samples), setup.trainer_batch):
        chunk = samples[i : i + setup.trainer_batch]
        batch = pack(chunk, torch.zeros(len(chunk))).to(torch.device(device))
        logp, experts = scorer(batch)  # [B, S], [L, B, S, k]
        if experts is None or batch.routed_experts is None:
            raise RuntimeError("the benchmark model is an MoE: routing must be reported")
        mask = batch.loss_mask  # [B, S]
        trainer_lp.append(logp[mask].cpu())
        own.append(experts[:, mask].cpu())
        used.append((batch.routed_experts[:, mask] if replay else experts[:, mask]).cpu())
    return torch.cat(trainer_lp), torch.cat(used, 1), torch.cat(own, 1)


def score_features(model: HFCausalLM, batch: PackedBatch, *, replay: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad trainer log-probs [B, S] and own experts [L, B, S, k] via `features` → LM head (fp32)."""
    with torch.no_grad():
        feats = model.features(batch.inputs, key_mask=batch.key_mask,
                               routed_experts=batch.routed_experts if replay else None)
        logits = (feats.hidden.float() @ model.output_weight().float().T) / batch.temperature[:, None, None]
        return sampled_token_logprobs(logits, batch.targets), feats.routed_experts  # [B, S, V] → [B, S]


def case(
    trainer: str, replay: bool, engine_lp: torch.Tensor, recorded: torch.Tensor,
    t: torch.Tensor, used: torch.Tensor, own: torch.Tensor,
) -> dict[str, Any]:
    """One row of figures: trainer log-probs ``t`` [N] and experts [L, N, k] against the engine's."""
    everywhere = torch.ones_like(t, dtype=torch.bool)  # [N]
    return {
        "name": f"{trainer}{' + replay' if replay else ''}",
        "trainer": trainer,
        "replay": replay,
        "kl": kl_k3(engine_lp, t, everywhere),
        "max_abs_dlogprob": max_abs_logprob_diff(t, engine_lp, everywhere),
        # as a batch: experts [L, 1, N, k], mask [1, N]
        "router_flip_rate": router_flip_rate(used[:, None], recorded[:, None], everywhere[None]),
        "router_own_flip_rate": router_flip_rate(own[:, None], recorded[:, None], everywhere[None]),
        "tokens": int(t.numel()),
    }


def summarize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """KL reduction by replay per trainer variant (bf16, amp and fp32, or fp32 alone), and the worst."""
    by = {(c["trainer"], c["replay"]): c for c in cases}
    reductions = {}
    for name in dict.fromkeys(c["trainer"] for c in cases):
        with_replay = by[(name, True)]["kl"]
        reductions[name] = by[(name, False)]["kl"] / with_replay if with_replay > 0 else float("inf")
    return {
        "replay_kl_reduction": min(reductions.values()),
        "replay_kl_reduction_by_trainer": reductions,
        "replay_flip_rate_max": max(c["router_flip_rate"] for c in cases if c["replay"]),
    }


def json_meta() -> dict[str, Any]:
    """`meta()` made JSON-encodable: ``torch.__version__`` is a str subclass msgspec refuses to encode.
    (Belongs in `rlbus_tools.bench.common.meta`; shared with `rlbus_tools.bench.train` until it moves there.)"""
    info = meta()
    if info.get("torch") is not None:
        info["torch"] = str(info["torch"])
    return info


MODELS = ("policy", "hf-moe")
"""``--model``: ``policy`` (rlbus's MoE, warmed up first: the default) or ``hf-moe`` (a random Qwen3-MoE
from ``transformers``, routed through `rlbus.models.hf_moe.RouterTap`)."""


def run(
    quick: bool = False, json_path: Path | None = None, model: str = "policy", engine: str = "torch",
    device: str = "cpu",
) -> dict[str, Any]:
    """The torch engine's mismatch on ``device`` (the warm-up trains on the CPU; the engine and the trainer's
    re-scoring then run on ``device``), or another engine kind's."""
    kind = engine_kind(engine, field="--engine")
    if engine in OWN_RUNS:
        return OWN_RUNS[engine](quick=quick, json_path=json_path)
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    setup = QUICK if quick else FULL
    t0 = time.perf_counter()
    if model == "hf-moe":
        hf = random_hf_moe(setup)
        t1 = time.perf_counter()
        cases = measure_hf(hf, setup, engine=kind, device=device)
        cfg = hf.hf.config
        shape = {"kind": "hf-moe", "family": cfg.model_type, "d_model": cfg.hidden_size,
                 "n_layer": cfg.num_hidden_layers, "n_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
                 "params": hf.num_params(), "warmup_steps": 0}  # fmt: skip
        title = "random Qwen3-MoE (transformers)"
    else:
        policy = train(setup)
        t1 = time.perf_counter()
        cases = measure(policy, setup, engine=kind, device=device)
        pc = policy.config
        shape = {"kind": "policy", "d_model": pc.d_model, "n_layer": pc.n_layer, "n_experts": pc.n_experts,
                 "top_k": pc.top_k, "params": policy.num_params(), "warmup_steps": setup.train_steps}  # fmt: skip
        title = "MoE"
    t2 = time.perf_counter()
    summary = summarize(cases)
    print_table(
        f"trainer vs bf16 engine, {title} {shape['n_layer']}L {shape['n_experts']}E top-{shape['top_k']} "
        f"d{shape['d_model']}",
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
        "engine": engine,
        "quick": quick,
        "meta": json_meta(),
        "device": device,
        "model": shape,
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


# --- the same figures with vLLM as the engine (`--engine vllm`, run in the vLLM environment) ------------


def vllm_moe_config(d_model: int) -> Any:
    """A random ``transformers`` Mixtral for vLLM: 4 layers, 8 experts top-2, head size 64 (the CPU attention
    kernels' smallest), the byte vocabulary, untied LM head."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=272, hidden_size=d_model, intermediate_size=d_model, num_hidden_layers=4,
        num_attention_heads=max(1, d_model // 64), num_key_value_heads=max(1, d_model // 128),
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=160, tie_word_embeddings=False,
    )  # fmt: skip


def measure_vllm(
    master: HFCausalLM, directory: Path, prompts: list[tuple[int, ...]], setup: Setup, *, seed: int = 1,
    tokenizer: bool = True,
) -> list[dict[str, Any]]:
    """vLLM (bf16, from ``directory``) generates; the trainer re-scores through `HFCausalLM.features` with the
    bf16 cast and the fp32 master, with and without router replay for an MoE.

    CPU vLLM returns no routing (``enable_return_routed_experts`` needs Triton), so for an MoE the engine
    hooks vLLM's router gates (`VLLMEngine.record_routing`) and runs one request at a time with the prefix
    cache off, so each forward's tokens are that request's, in order."""
    from dataclasses import replace

    from rlbus.engines.vllm_engine import VLLMEngine

    moe = master.is_moe
    kwargs: dict[str, Any] = {"enable_prefix_caching": False}
    if not tokenizer:
        kwargs["skip_tokenizer_init"] = True
    engine = VLLMEngine(directory, dtype="bfloat16", seed=seed, max_batch=setup.engine_batch, llm_kwargs=kwargs)
    try:
        if moe:
            engine.record_routing(int(master.hf.config.num_experts_per_tok))
        results = []
        for i, p in enumerate(prompts):
            engine.take_routing()  # drop anything not of this request
            req = GenerationRequest(prompt_ids=p, max_new_tokens=setup.new_tokens, temperature=1.0, seed=seed + i)
            (r,) = engine.generate([req])
            if moe:
                experts = engine.take_routing()  # [L, P + N - 1, k]
                fed = len(p) + len(r.token_ids) - 1
                if experts.shape[1] != fed:
                    raise RuntimeError(f"vLLM routed {experts.shape[1]} tokens, expected {fed}")
                r = replace(r, routed_experts=experts)
            results.append(r)
    finally:
        engine.close()
    samples = [sample_from_generation(r) for r in results]
    engine_lp = torch.cat([r.logprobs for r in results])  # [N]
    recorded = None
    if moe:
        recorded = torch.cat([r.routed_experts[:, len(r.prompt_ids) - 1 :] for r in results  # [L, N, k]
                              if r.routed_experts is not None], dim=1).long()
    bf16 = inference_copy(master)
    cases = []
    for name, trainer in (("bf16", bf16), ("fp32", master)):
        for replay in (False, True) if moe else (False,):
            scorer = partial(score_features, trainer, replay=replay)
            if recorded is not None:
                scored = rescore(samples, setup, scorer, replay=replay)
                cases.append(case(name, replay, engine_lp, recorded, *scored))
            else:
                cases.append(dense_case(name, engine_lp, rescore_dense(samples, setup, scorer)))
    return cases


def rescore_dense(samples: list[Sample], setup: Setup, scorer: Scorer) -> torch.Tensor:
    """Trainer log-probs [N] at every generated token of a dense model, ``trainer_batch`` rows at a time."""
    out = []
    for i in range(0, len(samples), setup.trainer_batch):
        chunk = samples[i : i + setup.trainer_batch]
        batch = pack(chunk, torch.zeros(len(chunk)))
        logp, _ = scorer(batch)
        out.append(logp[batch.loss_mask])
    return torch.cat(out)


def dense_case(trainer: str, engine_lp: torch.Tensor, t: torch.Tensor) -> dict[str, Any]:
    """`case` for a dense model: no routing, no flips."""
    everywhere = torch.ones_like(t, dtype=torch.bool)
    return {"name": trainer, "trainer": trainer, "replay": False, "kl": kl_k3(engine_lp, t, everywhere),
            "max_abs_dlogprob": max_abs_logprob_diff(t, engine_lp, everywhere), "router_flip_rate": None,
            "router_own_flip_rate": None, "tokens": int(t.numel())}


def vllm_models(setup: Setup, root: Path) -> list[tuple[str, HFCausalLM, Path, list[tuple[int, ...]], bool]]:
    """(label, fp32 master, model directory for vLLM, prompts, has a tokenizer): SmolLM2-135M-Instruct (the
    shipped real model, when installed) and a random Mixtral saved to ``root``."""
    from rlbus.models.sources import load_tokenizer, model_dir

    out = []
    lines = corpus(setup.prompts, 2)
    try:
        smol = model_dir(name="smollm2-135m-instruct")
    except ConfigError as exc:
        print(f"SmolLM2 skipped: {exc}")
    else:
        tok = load_tokenizer(smol)
        prompts = [tuple(tok.encode(line)[: 6 + i % 9]) for i, line in enumerate(lines)]
        out.append(("smollm2-135m-instruct", HFCausalLM.from_pretrained(smol), smol, prompts, True))
    moe = HFCausalLM.from_config(vllm_moe_config(setup.d_model * 2), seed=0).eval()
    moe_dir = root / "mixtral"
    moe.hf.save_pretrained(str(moe_dir))
    prompts = [(BOS_ID, *line.encode()[: 8 + i % 9]) for i, line in enumerate(lines)]
    out.append(("random Mixtral", moe, moe_dir, prompts, False))
    return out


def run_vllm(quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    """``rlbus bench mismatch --engine vllm``: KL(vLLM ‖ trainer), max |Δ log-prob|, router flips with and
    without replay, on SmolLM2 and a random Mixtral."""
    import tempfile

    setup = QUICK if quick else FULL
    t0 = time.perf_counter()
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-mismatch-") as tmp:
        for label, master, directory, prompts, has_tok in vllm_models(setup, Path(tmp)):
            cases = measure_vllm(master, directory, prompts, setup, tokenizer=has_tok)
            cfg = master.hf.config
            models[label] = {"family": cfg.model_type, "params": master.num_params(), "cases": cases,
                             "summary": summarize(cases) if master.is_moe else None}
            print_table(
                f"trainer vs vLLM (bf16, CPU), {label}",
                ["case", "KL k3", "max|Δlp|", "flips used", "flips own", "tokens"],
                [[c["name"], f"{c['kl']:.3e}", f"{c['max_abs_dlogprob']:.4f}",
                  "-" if c["router_flip_rate"] is None else f"{c['router_flip_rate']:.4f}",
                  "-" if c["router_own_flip_rate"] is None else f"{c['router_own_flip_rate']:.4f}", c["tokens"]]
                 for c in cases],
            )
    result = {
        "benchmark": "mismatch", "engine": "vllm", "quick": quick, "meta": json_meta(), "models": models,
        "setup": {"prompts": setup.prompts, "new_tokens": setup.new_tokens, "trainer_batch": setup.trainer_batch,
                  "engine_dtype": "bf16", "temperature": 1.0},
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    write_json(json_path, result)
    return result


#: Engines measured on models of their own instead of serving the bf16 copy above: vLLM loads a Hugging Face
#: directory itself (no in-house policy), so its run measures SmolLM2 and a random Mixtral.
OWN_RUNS: dict[str, Callable[..., dict[str, Any]]] = {"vllm": run_vllm}


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    model: Annotated[str, typer.Option(help="policy (rlbus's MoE) or hf-moe (a random Qwen3-MoE).")] = "policy",
    engine: Annotated[str, typer.Option(
        help="A registered engine (rlbus.engines.kinds): torch, vllm (SmolLM2 and a random Mixtral on vLLM; run "
             "it with .venv-vllm's rlbus), or an installed package's, which serves the bf16 copy in place of "
             "the torch engine.")] = "torch",
    device: Annotated[str, typer.Option(help="The torch engine's and the trainer's device: auto, cpu, cuda …")] = "cpu",
) -> None:
    """Training/inference mismatch: KL, |Δlogprob| and router flips, with and without router replay."""
    if model not in ("policy", "hf-moe"):
        raise typer.BadParameter("--model is policy or hf-moe")
    try:
        engine_kind(engine, field="--engine")
    except ConfigError as exc:
        raise typer.BadParameter(exc.problem, param_hint="--engine") from None
    from rlbus.models.device import announce

    run(quick=quick, json_path=json_path, model=model, engine=engine, device=str(announce(device, say=print).device))
