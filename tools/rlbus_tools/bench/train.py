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

Publishing on and off: the ~11M model's trainer (`Trainer`) publishing every step's weights to a local
blob store, inline after each step and overlapped with the next step, against the same trainer without a
publisher (`measure_publishing`; ``summary.overlapped_vs_off``, target ≥ 0.9).

``--device cuda`` runs the same step on a GPU, bf16 compute over the fp32 master weights (``compute_dtype =
"auto"``), and reports model FLOP utilisation: MFU = model FLOPs per second / the same run's measured
matmul peak (a bf16 GEMM on random 8192² operands timed with CUDA events; on the CPU an fp32 GEMM), model
FLOPs by the usual count — 6 FLOPs per matmul parameter per position fed (forward and backward), the LM
head's 6·V·D per trained token, and 12·L·d·T per position for attention (Chowdhery et al., "PaLM", 2022,
appendix B). ``--size 1.5b`` trains a ~1.5 B model with Qwen2.5-1.5B's configuration and random weights
(transformers' ``Qwen2Config``; no download) on a larger batch instead of the policy sizes.

``--world-size 2`` measures the trainer on N ranks instead (FSDP2 over gloo on CPU,
`rlbus.training.ranks`): the same seeded batches through a `Trainer` on 1 rank — the baseline, in the same
run — and on N spawned ranks (`rlbus.training.spawn`), each step followed by `Trainer.publish` to a real
`WeightPublisher` (fp32, a local blob store) and the run closed by a checkpoint save and a restore. It
reports tokens/s per rank, each rank's model + optimizer bytes and RSS high-water, publish and checkpoint
times, and checks that N ranks reproduce the 1-rank run bit for bit (losses, weights) and that a worker
applying the published keyframe + delta chain from the blob store (`rlbus.weights.sync.WeightSync`)
rebuilds the trainer's weights exactly. See `run_ranks`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.training.batch import Group, Sample
from rlbus.training.step import GRPOConfig, OptimConfig, build_optimizer, grpo_step
from rlbus_tools.bench.common import Device, JsonPath, Quick, print_table, require, write_json
from rlbus_tools.bench.mismatch import json_meta


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
    #: A Hugging Face model directory to train instead of a policy of ``config`` (the N-rank bench's
    #: ``--model``; ``config`` then only says the model is dense: no recorded experts in the batches).
    hf_dir: str | None = None
    #: A ``transformers`` config to train with random weights instead (``--size 1.5b``; dense, like hf_dir).
    hf_config: Any = None
    #: Rows per forward/backward chunk (0: the whole batch at once).
    micro_batch_rows: int = 0


def build_model(size: Size, device: str = "cpu") -> Any:
    """The model ``size`` trains, on ``device``: the Hugging Face model in ``hf_dir`` (its weights), a random one
    of ``hf_config`` (initialised on the device), else a seeded policy."""
    from rlbus.models.hf import HFCausalLM

    if size.hf_dir is not None:
        return HFCausalLM.from_pretrained(size.hf_dir, device=device)
    if size.hf_config is not None:
        with torch.device(device):
            return HFCausalLM.from_config(size.hf_config, seed=0)
    torch.manual_seed(0)
    return Policy(size.config).to(device)


def qwen25_1p5b_config() -> Any:
    """Qwen2.5-1.5B's configuration (28 layers, d 1536, GQA 12/2, SwiGLU 8960, vocabulary 151,936, tied
    embeddings, q/k/v biases): 1.54 B parameters."""
    from transformers import Qwen2Config

    shape: dict[str, Any] = {  # rope_theta: the legacy key, which every transformers 5 release accepts
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
    }
    return Qwen2Config(**shape)


def size_1p5b(quick: bool) -> Size:
    """The ~1.5 B row: 64 sequences of 128 + 384 tokens a step (16 rows per forward/backward); ``quick``, 16."""
    if quick:
        return Size("~1.5B", dense_config(True), groups=2, group_size=8, prompt=64, completion=192, steps=2,
                    hf_config=qwen25_1p5b_config(), micro_batch_rows=16)
    return Size("~1.5B", dense_config(True), groups=8, group_size=8, prompt=128, completion=384, steps=3,
                hf_config=qwen25_1p5b_config(), micro_batch_rows=16)


def matmul_peak(device: str, seconds: float = 1.0) -> dict[str, Any]:
    """This run's measured matmul rate: a bf16 8192² GEMM on CUDA (random operands, three sets in rotation,
    CUDA events, the median of the timed products after a warm-up), an fp32 1024² GEMM on the CPU."""
    import statistics

    cuda = torch.device(device).type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    operands = [(torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype))
                for _ in range(3)]  # fmt: skip
    times: list[float] = []
    started = time.perf_counter()
    for i in range(1000):
        a, b = operands[i % 3]
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            a @ b
            end.record()
            end.synchronize()
            elapsed = begin.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            elapsed = time.perf_counter() - t0
        if i >= 3:
            times.append(elapsed)
        if time.perf_counter() - started > seconds and len(times) >= 10:
            break
    median = statistics.median(times)
    return {"gemm": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}", "median_s": median,
            "flops_per_s": 2 * n**3 / median, "samples": len(times)}


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.1f} T" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} G"


def train_flops(model: Any, size: Size) -> float:
    """Model FLOPs of one step (see the module docstring): matmul parameters × positions fed × 6, the LM head
    × trained tokens × 6, attention 12·L·d·T per position. MoE experts count at top_k / n_experts."""
    embedding = model.hf.get_input_embeddings().weight if hasattr(model, "hf") else model.wte.weight
    head = model.output_weight()
    cfg = size.config
    body = 0.0
    for name, p in model.named_parameters():
        if p.dim() != 2 or p is embedding or p is head:
            continue
        share = cfg.top_k / cfg.n_experts if (size.hf_dir is None and size.hf_config is None and ".experts." in name) \
            else 1.0
        body += share * p.numel()
    if hasattr(model, "hf"):
        layers, width = model.hf.config.num_hidden_layers, model.hf.config.hidden_size
    else:
        layers, width = cfg.n_layer, cfg.d_model
    T = size.prompt + size.completion
    positions = size.groups * size.group_size * (T - 1)
    trained = size.groups * size.group_size * size.completion
    return 6 * body * positions + 6 * head.numel() * trained + 12 * layers * width * T * positions


def small_config() -> PolicyConfig:
    """~11M parameters: the CPU-sized training model."""
    return PolicyConfig(vocab=272, d_model=256, n_layer=6, n_head=8, max_seq=512, n_experts=8, top_k=2, d_ff=256)


FULL = (
    Size("~11M", small_config(), groups=4, group_size=4, prompt=32, completion=96, steps=4),
    Size("~95M", PolicyConfig.bench(), groups=4, group_size=4, prompt=32, completion=96, steps=2),
)
QUICK = (Size("~11M", small_config(), groups=2, group_size=4, prompt=16, completion=48, steps=2),)


def synthetic_groups(size: Size, seed: int, version: int = 0) -> list[Group]:
    """Seeded random groups with the shapes of ``size`` (see the module docstring), sampled by ``version``.
    A dense model (no experts) gets no recorded experts."""
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
                    versions=torch.where(mask, version, -1),
                    routed_experts=torch.rand(cfg.n_layer, T, cfg.n_experts, generator=g).argsort(-1)[..., : cfg.top_k]
                    if cfg.n_experts else None,
                )
            )
        groups.append(Group(samples=tuple(samples), rewards=torch.rand(size.group_size, generator=g).round()))
    return groups


def measure(size: Size, *, replay: bool, seed: int = 0, device: str = "cpu",
            peak: float | None = None) -> dict[str, Any]:
    """Time ``size.steps`` GRPO steps (after a warm-up) of a fresh model on ``device``; returns one table row's
    figures (with MFU against ``peak`` FLOP/s when given)."""
    from rlbus_tools.bench.common import synchronize

    torch.manual_seed(seed)
    model = build_model(size, device)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-5))
    config = GRPOConfig(router_replay=replay, normalize_std=False, micro_batch_rows=size.micro_batch_rows)
    batches = [synthetic_groups(size, seed + i) for i in range(size.steps + 1)]
    grpo_step(model, optimizer, batches[0], config=config, version=0)
    synchronize(device)
    started = time.perf_counter()
    trained = 0
    for groups in batches[1:]:
        trained += grpo_step(model, optimizer, groups, config=config, version=0).tokens
    synchronize(device)
    elapsed = time.perf_counter() - started
    sequences = size.groups * size.group_size
    processed = size.steps * sequences * (size.prompt + size.completion - 1)
    flops = size.steps * train_flops(model, size)
    params = sum(p.numel() for p in model.parameters())
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None
    return {
        "model": size.name,
        "params": params,
        "replay": replay,
        "device": device,
        "compute": "bf16 autocast over fp32" if torch.device(device).type == "cuda" else "fp32",
        "steps": size.steps,
        "sequences_per_step": sequences,
        "tokens_per_sequence": size.prompt + size.completion,
        "seconds": elapsed,
        "steps_per_s": size.steps / elapsed,
        "tokens_per_s": processed / elapsed,
        "trained_tokens_per_s": trained / elapsed,
        "model_flops_per_s": flops / elapsed,
        "mfu": None if peak is None else flops / elapsed / peak,
        "peak_memory_gib": memory,
    }


PUBLISH_MODES = (("off", None), ("after each step", False), ("overlapped", True))


def measure_publishing(size: Size) -> list[dict[str, Any]]:
    """Steps/s of a `Trainer` publishing every step's weights (bf16, a local blob store) against the same
    trainer without a publisher, on identical batches: publishing inline after each step, and overlapped
    (`Trainer` ``overlap_publish``: version N is encoded and uploaded while step N+1 trains). The first step
    (and the keyframe it publishes) is a warm-up; the timed run ends when the last version is announced."""
    import asyncio
    import tempfile

    from rlbus.blobs.local import LocalStore
    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.topics import topic_specs
    from rlbus.training.trainer import Trainer
    from rlbus.weights.publish import WeightPublisher

    async def one(overlap: bool | None, root: Path) -> dict[str, Any]:
        bus = MemoryBus(topic_specs())
        await bus.start()
        publisher = None if overlap is None else WeightPublisher(bus=bus, store=LocalStore(root), keyframe_every=1000)
        torch.manual_seed(0)
        trainer = Trainer(model=Policy(size.config), optim=OptimConfig(lr=1e-5),
                          grpo=GRPOConfig(normalize_std=False, max_staleness=size.steps + 1), publisher=publisher,
                          overlap_publish=bool(overlap))
        await trainer.train_on(synthetic_groups(size, 0))
        await trainer.drain()
        started = time.perf_counter()
        loop_publish = 0.0
        for k in range(1, size.steps + 1):
            metrics = await trainer.train_on(synthetic_groups(size, k, version=trainer.version))
            loop_publish += metrics["publish_s"]
        await trainer.drain()
        elapsed = time.perf_counter() - started
        await bus.close()
        history = publisher.history[1:] if publisher is not None else []
        return {"steps_per_s": size.steps / elapsed, "seconds": elapsed, "loop_publish_s": loop_publish / size.steps,
                "encode_s": sum(h.encode_s for h in history) / max(1, len(history)),
                "upload_s": sum(h.upload_s for h in history) / max(1, len(history)),
                "version": trainer.version}

    rows = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-train-publish-") as tmp:
        for i, (label, overlap) in enumerate(PUBLISH_MODES):
            rows.append({"model": size.name, "publishing": label, **asyncio.run(one(overlap, Path(tmp) / str(i)))})
    base = rows[0]["steps_per_s"]
    for row in rows:
        row["vs_off"] = row["steps_per_s"] / base
    return rows


def run(
    quick: bool = False, json_path: Path | None = None, world_size: int = 1, model: str | None = None,
    device: str = "cpu", size: str = "policy",
) -> dict[str, Any]:
    """The single-process table on ``device`` (``size``: ``policy``, the two policy sizes with and without
    replay, or ``1.5b``); with ``world_size`` > 1 the N-rank comparison (`run_ranks`) instead, on ``model``
    (a shipped model's name, e.g. ``smollm2-135m-instruct``) when given."""
    if world_size > 1:
        return run_ranks(world_size, quick=quick, json_path=json_path, model=model)
    if model is not None:
        raise ValueError("--model is for the N-rank comparison (--world-size N)")
    peak = matmul_peak(device)
    if size == "1.5b":
        rows = [measure(size_1p5b(quick), replay=False, device=device, peak=peak["flops_per_s"])]
    else:
        rows = [measure(s, replay=replay, device=device, peak=peak["flops_per_s"])
                for s in (QUICK if quick else FULL) for replay in (False, True)]  # fmt: skip
    where = f"CPU ({torch.get_num_threads()} threads), fp32" if torch.device(device).type == "cpu" else \
        f"{torch.cuda.get_device_name(device)}, bf16 autocast over fp32 masters"
    print_table(
        f"GRPO trainer step on {where}; matmul peak measured {_rate(peak['flops_per_s'])}",
        ["model", "replay", "params", "steps/s", "tokens/s", "trained tok/s", "model FLOP/s", "MFU"],
        [
            [
                r["model"],
                "yes" if r["replay"] else "no",
                f"{r['params'] / 1e6:.1f}M",
                f"{r['steps_per_s']:.3f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['trained_tokens_per_s']:,.0f}",
                _rate(r["model_flops_per_s"]),
                f"{r['mfu']:.1%}",
            ]
            for r in rows
        ],
        width=120,
    )
    result: dict[str, Any] = {"benchmark": "train", "quick": quick, "meta": json_meta(), "device": device,
                              "size": size, "matmul_peak": peak, "rows": rows,
                              "summary": {"tokens_per_s": rows[-1]["tokens_per_s"], "mfu": rows[-1]["mfu"]}}
    if size == "policy" and torch.device(device).type == "cpu":
        publishing = [r for s in (QUICK if quick else FULL[:1]) for r in measure_publishing(replace(s, steps=6))]
        print_table(
            "the same trainer publishing every step (bf16, local blob store): steps/s against no publishing",
            ["model", "publishing", "steps/s", "× off", "loop s/step", "encode s", "upload s"],
            [[r["model"], r["publishing"], f"{r['steps_per_s']:.3f}", f"{r['vs_off']:.2f}",
              f"{r['loop_publish_s']:.3f}", f"{r['encode_s']:.3f}", f"{r['upload_s']:.3f}"] for r in publishing],
        )
        overlapped = next(r for r in publishing if r["publishing"] == "overlapped")
        result["publishing"] = publishing
        result["summary"] |= {"overlapped_vs_off": overlapped["vs_off"],
                              "overlapped_ge_0.9x_off": overlapped["vs_off"] >= 0.9}
    write_json(json_path, result)
    return result


# --- the trainer on N ranks ------------------------------------------------------------------------------
def dense_config(quick: bool) -> PolicyConfig:
    """A dense policy (no experts): FSDP on N ranks matches one process bit for bit only for dense models
    (an expert no rank routed to is still stepped by AdamW on N ranks: `rlbus.training.ranks`)."""
    if quick:
        return PolicyConfig(vocab=272, d_model=128, n_layer=4, n_head=4, max_seq=128, n_experts=0, d_ff=512)
    return PolicyConfig(vocab=272, d_model=512, n_layer=8, n_head=8, max_seq=256, n_experts=0, d_ff=2048)


def ranks_size(quick: bool, model: str | None = None) -> Size:
    if model is not None:  # a real model: a smaller batch, as each step is ~135 M parameters' worth on CPU
        from rlbus.models.sources import model_dir

        directory = str(model_dir(name=model, progress=print))
        return Size(model, dense_config(True), groups=2, group_size=4, prompt=32, completion=64,
                    steps=1 if quick else 2, hf_dir=directory)
    if quick:
        return Size("dense ~1M", dense_config(True), groups=2, group_size=4, prompt=16, completion=48, steps=2)
    return Size("dense ~34M", dense_config(False), groups=4, group_size=4, prompt=32, completion=96, steps=3)


def _local_bytes(tensors: Any) -> int:
    """Bytes of the tensors this rank holds: a DTensor counts its local shard only."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def _rank_run(ranks: Any, size: Size, directory: str, slices: int) -> None:
    """One rank of the N-rank measurement (or the 1-rank baseline, ``ranks`` None); writes ``rank-<r>.pt``.

    Every rank builds the same seeded model and the same batches; the leader drives a `Trainer` (warm-up
    step, timed steps each followed by a timed `Trainer.publish`, then `save` and `restore`), the followers
    run its commands (`Trainer.follow`). Every run trains each step in ``slices`` chunks of rows — one per
    rank on N ranks, N micro-batches on 1 — so on 2 ranks in fp32 the update is the 1-rank one bit for bit
    (`rlbus.training.step`, "On N ranks"); with more ranks the summation order differs and
    ``matches_single_process`` can be false by float rounding."""
    import asyncio
    import resource

    from rlbus.blobs.local import LocalStore
    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.topics import topic_specs
    from rlbus.training.config import FSDPConfig
    from rlbus.training.ranks import shard_model
    from rlbus.training.trainer import Trainer
    from rlbus.weights.publish import WeightPublisher

    root = Path(directory)
    rank = 0 if ranks is None else ranks.rank
    rows = size.groups * size.group_size
    model = build_model(size)
    if ranks is not None:
        shard_model(model, ranks, FSDPConfig())
    grpo = GRPOConfig(router_replay=False, normalize_std=False, max_grad_norm=0.0, micro_batch_rows=-(-rows // slices))
    leader = rank == 0
    publisher = None
    bus = MemoryBus(topic_specs())
    if leader:  # fp32 and one keyframe: the worker rebuilds the exact fp32 weights from keyframe + deltas
        publisher = WeightPublisher(bus=bus, store=LocalStore(root / "blobs"), dtype=torch.float32,
                                    keyframe_every=1_000_000, retain_versions=1_000_000)
    trainer = Trainer(model=model, optim=OptimConfig(lr=1e-3, weight_decay=0.1), grpo=grpo, publisher=publisher,
                      checkpoint_dir=root / "checkpoints", publish_every=1_000_000, ranks=ranks)
    out: dict[str, Any] = {"rank": rank}

    async def lead() -> None:
        await bus.start()
        await trainer.publish()  # v1: the keyframe of the initial weights (compiles the codec: not timed)
        losses, step_s, publish_s = [], [], []
        for k in range(size.steps + 1):
            t0 = time.perf_counter()
            metrics = await trainer.train_on(synthetic_groups(size, k, version=trainer.version))
            t1 = time.perf_counter()
            await trainer.publish()
            t2 = time.perf_counter()
            losses.append(float(metrics["loss"]))
            if k:  # step 0 is the warm-up
                step_s.append(t1 - t0)
                publish_s.append(t2 - t1)
        t0 = time.perf_counter()
        await trainer.save()
        t1 = time.perf_counter()
        await trainer.restore()
        t2 = time.perf_counter()
        trainer.release()
        await bus.close()
        out.update(losses=losses, step_s=step_s, publish_s=publish_s, save_s=t1 - t0, load_s=t2 - t1,
                   version=trainer.version)

    if leader:
        asyncio.run(lead())
    else:
        trainer.follow()
    state = [t for s in trainer.optimizer.state.values() for t in s.values()]
    out.update(param_bytes=_local_bytes(model.parameters()), optimizer_bytes=_local_bytes(state),
               rss_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    torch.save(out, root / f"rank-{rank}.pt")


async def _rebuild(directory: Path, version: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a worker holds after applying the published chain up to ``version`` from the blob store:
    v1's keyframe, then every delta after it (`WeightSync.rebuild` from nothing, digests checked)."""
    from rlbus.blobs.local import LocalStore
    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.topics import topic_specs
    from rlbus.weights.sync import WeightSync

    state = {name: torch.zeros_like(t) for name, t in like.items()}
    sync = WeightSync(bus=MemoryBus(topic_specs()), store=LocalStore(directory / "blobs"), state=state)
    await sync.rebuild(version)
    assert sync.version == version
    return state


def _trainer_weights(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The trainer's final weights as its checkpoint holds them (rank 0 gathers them on N ranks)."""
    from rlbus.training.checkpoint import load_checkpoint

    saved = load_checkpoint(directory / "checkpoints")
    assert saved is not None
    return {name: saved.model[name] for name in names}


def measure_ranks(size: Size, world: int, directory: Path, *, threads: int, slices: int) -> dict[str, Any]:
    """Run `_rank_run` on ``world`` spawned ranks; every rank's figures, rank 0's first."""
    from rlbus.training.spawn import spawn_ranks

    directory.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_rank_run, world, size, str(directory), slices, threads=threads, timeout_s=600)
    return {"ranks": [torch.load(directory / f"rank-{r}.pt", weights_only=True) for r in range(world)]}


def run_ranks(
    world: int = 2, quick: bool = False, json_path: Path | None = None, model: str | None = None
) -> dict[str, Any]:
    """The trainer on ``world`` ranks against the 1-rank trainer on the same batches, in the same run.

    Threads: one torch thread per process, the baseline's too (two OpenMP threads on a shared 2-core VM
    were up to 20× slower than one: bench/RESULTS.md, "train"), so N ranks use N cores where the baseline
    uses one; ``tokens_per_s`` is per rank, ``tokens_per_s_total`` the whole trainer's. Memory
    per rank is reported twice: ``model_optimizer_mb``, the bytes of the parameters and AdamW moments this
    rank holds (its FSDP shards: what sharding divides), and ``rss_peak_mb``, the process's RSS high-water
    (getrusage ru_maxrss: the interpreter, torch, activations, gathered parameters and the publisher's
    snapshot included, so it shrinks far less)."""
    import asyncio
    import tempfile

    if world < 2:
        raise ValueError("--world-size compares N ≥ 2 ranks against one; plain `rlbus bench train` is 1 rank")
    size = ranks_size(quick, model)
    reference = build_model(size)
    names = [name for name, _ in reference.named_parameters()]
    params = reference.num_params()
    del reference
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-ranks-") as tmp:
        runs = {n: measure_ranks(size, n, Path(tmp) / f"world-{n}", threads=1, slices=world) for n in (1, world)}
        weights = {n: _trainer_weights(Path(tmp) / f"world-{n}", names) for n in runs}
        rebuilt = {n: asyncio.run(_rebuild(Path(tmp) / f"world-{n}", runs[n]["ranks"][0]["version"], weights[n]))
                   for n in runs}
    for n, run in runs.items():
        lead = run["ranks"][0]
        step = sum(lead["step_s"]) / len(lead["step_s"])
        tokens = size.groups * size.group_size * (size.prompt + size.completion - 1)  # positions fed a step
        for r in run["ranks"]:
            rows.append({
                "world_size": n, "rank": r["rank"], "step_s": step, "tokens_per_s": tokens / n / step,
                "tokens_per_s_total": tokens / step,
                "model_optimizer_mb": (r["param_bytes"] + r["optimizer_bytes"]) / 2**20,
                "rss_peak_mb": r["rss_peak_bytes"] / 2**20,
                "publish_s": sum(lead["publish_s"]) / len(lead["publish_s"]),
                "save_s": lead["save_s"], "load_s": lead["load_s"],
            })
    one, many = runs[1]["ranks"][0], runs[world]["ranks"][0]
    matches = one["losses"] == many["losses"] and _same(weights[1], weights[world])
    exact = all(_same(rebuilt[n], weights[n]) for n in runs)
    print_table(
        f"GRPO trainer on 1 vs {world} ranks (FSDP2, gloo, CPU fp32), {size.name}, "
        f"{size.groups * size.group_size} × {size.prompt + size.completion} tokens a step",
        ["world", "rank", "step s", "tok/s/rank", "W+Adam MB", "RSS MB", "publish s", "save s", "load s"],
        [[str(r["world_size"]), str(r["rank"]), f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}",
          f"{r['model_optimizer_mb']:.1f}", f"{r['rss_peak_mb']:.0f}", f"{r['publish_s']:.3f}",
          f"{r['save_s']:.3f}", f"{r['load_s']:.3f}"] for r in rows],
        width=120,
    )
    print(f"matches 1 rank bit for bit (losses, weights): {matches}; "
          f"delta chain rebuilt bit-exact from the blob store: {exact}")
    result = {
        "benchmark": "train", "quick": quick, "world_size": world, "meta": json_meta(), "model": size.name,
        "params": params, "rows": rows,
        "losses": {str(n): runs[n]["ranks"][0]["losses"] for n in runs},
        "summary": {
            "matches_single_process": matches,
            "delta_chain_bit_exact": exact,
            "model_optimizer_mb_per_rank": {str(n): [r["model_optimizer_mb"] for r in rows if r["world_size"] == n]
                                            for n in runs},
            "tokens_per_s_per_rank": {str(n): next(r["tokens_per_s"] for r in rows if r["world_size"] == n)
                                      for n in runs},
        },
    }
    write_json(json_path, result)
    return result


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    world_size: Annotated[int, typer.Option(
        min=1, help="N >= 2 runs the trainer on N gloo ranks (FSDP2, CPU) against 1 rank on the same batches: tokens/s "
                    "and memory per rank, publish and checkpoint times, exactness.")] = 1,
    model: Annotated[str | None, typer.Option(
        help="With --world-size N: a shipped model (smollm2-135m-instruct) instead of the dense policy.")] = None,
    device: Device = "auto",
    size: Annotated[str, typer.Option(
        help="policy (the ~11M and ~95M policies, with and without replay) or 1.5b (Qwen2.5-1.5B's config, "
             "random weights).")] = "policy",
) -> None:
    """The trainer: tokens/s per configuration, or N ranks against one."""
    from rlbus.models.device import announce

    if model is not None and world_size == 1:
        raise typer.BadParameter("--model is for the N-rank comparison: add --world-size 2")
    if size not in ("policy", "1.5b"):
        raise typer.BadParameter("--size is policy or 1.5b")
    where = str(announce(device, say=print).device) if world_size == 1 else "cpu"
    result = run(quick=quick, json_path=json_path, world_size=world_size, model=model, device=where, size=size)
    if world_size > 1:
        summary = result["summary"]
        require(summary["matches_single_process"] and summary["delta_chain_bit_exact"],
                "the N-rank trainer did not reproduce the 1-rank run exactly (see the JSON's summary)")
