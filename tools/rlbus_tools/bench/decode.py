"""``rlbus bench decode``: the torch engine against ``transformers.generate`` — tokens/s, decode-step latency,
greedy agreement — on one model, one device, the same prompts.

Per batch size (default 1 and 64): ``batch`` seeded prompts of 20–28 tokens (left padded for
``generate``), each sampling exactly ``new_tokens`` tokens at temperature 1 with no stop (both sides:
``min_new_tokens``, no EOS), after a warm-up of each side (the engine captures its CUDA graphs there).
Tokens/s is generated tokens over wall seconds, the median of ``repeats`` runs; the decode step is
(t(N tokens) − t(1 token)) / (N − 1), which takes the prefill out. Same-run baseline: ``transformers``'
own ``generate`` (sampling, its default dynamic KV cache, the same weights and dtype). Greedy agreement:
the engine's greedy tokens of the batch against ``generate``'s greedy tokens of each prompt alone, row by
row (in fp32 they must all agree; bf16 rounding may flip a near tie in a random model).

The model is the shipped SmolLM2-135M-Instruct (``--model smollm2-135m-instruct``, real weights when
installed) or a random one of a real configuration (``--model smollm2-135m``, ``qwen2.5-1.5b``,
``qwen2.5-7b``: `rlbus_tools.randmodels`), in bf16 on CUDA and fp32 on the CPU unless ``--dtype`` says.
Targets (issue 41, on an H200, SmolLM2 size): ≥ 1.5× ``generate`` at batch 64, ≤ 10 ms a decode step at
batch 1; on the CPU ≥ 1.0× at both.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from rlbus.engines.base import GenerationRequest
from rlbus.engines.torch_engine import TorchEngine
from rlbus_tools.bench.common import Device, JsonPath, Quick, print_table, synchronize, write_json
from rlbus_tools.bench.mismatch import json_meta

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def load(model: str, device: str, dtype: torch.dtype, layers: int | None = None) -> Any:
    """The shipped model by name (its weights), else a random model of `rlbus_tools.randmodels.CONFIGS`."""
    from rlbus.models.sources import SHIPPED, load_hf, model_dir
    from rlbus_tools import randmodels

    if model in SHIPPED:
        return load_hf(model_dir(name=model), dtype=dtype, device=device)
    return randmodels.build(model, device=device, dtype=dtype, layers=layers)


def prompts(vocab: int, batch: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 29, (batch,), generator=g).tolist()
    return [tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]


def engine_run(engine: TorchEngine, rows: list[tuple[int, ...]], new: int, *, greedy: bool = False,
               seed: int = 0) -> tuple[float, list[tuple[int, ...]]]:
    """(seconds, tokens) of one ``generate`` of ``rows``, each sampling exactly ``new`` tokens."""
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=new, temperature=0.0 if greedy else 1.0, seed=seed + i)
            for i, p in enumerate(rows)]  # fmt: skip
    synchronize(engine.model.device)
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    synchronize(engine.model.device)
    return time.perf_counter() - t0, [r.token_ids for r in results]


def hf_run(model: Any, rows: list[tuple[int, ...]], new: int, *, greedy: bool = False,
           seed: int = 0) -> tuple[float, list[tuple[int, ...]]]:
    """(seconds, tokens) of ``transformers.generate`` on ``rows`` as one left-padded batch."""
    P = max(map(len, rows))
    device = model.device
    ids = torch.full((len(rows), P), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    torch.manual_seed(seed)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                eos_token_id=None, pad_token_id=2, **sampling)  # fmt: skip
    synchronize(device)
    return time.perf_counter() - t0, [tuple(r) for r in out[:, P:].tolist()]


def _median(fn: Any, repeats: int) -> float:
    return statistics.median(fn()[0] for _ in range(repeats))


def measure(model: Any, batch: int, new: int, *, repeats: int, seed: int = 0, greedy_rows: int = 8) -> dict[str, Any]:
    """One batch size's figures (see the module docstring)."""
    engine = TorchEngine(model, max_batch=batch, seed=seed)
    rows = prompts(model.vocab_size, batch, seed)
    engine_run(engine, rows, new)  # warm-up: kernels, graphs of every bucket the run visits
    engine_run(engine, rows, 1)
    hf_run(model, rows, new)
    hf_run(model, rows, 1)
    e_new = _median(lambda: engine_run(engine, rows, new), repeats)
    e_one = _median(lambda: engine_run(engine, rows, 1), repeats)
    h_new = _median(lambda: hf_run(model, rows, new), repeats)
    h_one = _median(lambda: hf_run(model, rows, 1), repeats)
    check = rows[:greedy_rows]
    _, engine_greedy = engine_run(TorchEngine(model, max_batch=len(check)), check, min(new, 16), greedy=True)
    alone = [hf_run(model, [p], min(new, 16), greedy=True)[1][0] for p in check]
    tokens = batch * new
    graphs = engine.graphs
    return {
        "batch": batch, "new_tokens": new, "repeats": repeats, "static_path": engine.static,
        "engine_tokens_per_s": tokens / e_new, "hf_tokens_per_s": tokens / h_new,
        "speedup": h_new / e_new,
        "engine_step_ms": 1e3 * (e_new - e_one) / (new - 1), "hf_step_ms": 1e3 * (h_new - h_one) / (new - 1),
        "engine_s": e_new, "hf_s": h_new,
        "greedy_rows_equal": sum(a == b for a, b in zip(engine_greedy, alone, strict=True)),
        "greedy_rows": len(check),
        "graphs": None if graphs is None else {"captures": graphs.captures, "replays": graphs.replays,
                                               "enabled": graphs.enabled},
    }


def run(model: str = "smollm2-135m-instruct", batches: tuple[int, ...] = (1, 64), new_tokens: int = 64,
        device: str = "cpu", dtype: str | None = None, repeats: int = 3, layers: int | None = None,
        json_path: Path | None = None) -> dict[str, Any]:
    from rlbus.models.device import describe

    torch_dtype = DTYPES[dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")]
    lm = load(model, device, torch_dtype, layers).eval()
    rows = [measure(lm, b, new_tokens, repeats=repeats) for b in batches]
    print_table(
        f"rlbus bench decode — {model} ({lm.num_params() / 1e6:,.0f} M, {str(torch_dtype).removeprefix('torch.')}) "
        f"on {device}, {new_tokens} new tokens a row; baseline transformers.generate",
        ["batch", "engine tok/s", "generate tok/s", "speedup", "engine step ms", "generate step ms", "greedy equal"],
        [[r["batch"], r["engine_tokens_per_s"], r["hf_tokens_per_s"], f"{r['speedup']:.2f}×", r["engine_step_ms"],
          r["hf_step_ms"], f"{r['greedy_rows_equal']}/{r['greedy_rows']}"] for r in rows],
        width=120,
    )
    result = {"benchmark": "decode", "meta": json_meta(), "model": model, "params": lm.num_params(),
              "torch_threads": torch.get_num_threads(),
              "dtype": str(torch_dtype).removeprefix("torch."), "device": describe(torch.device(device)).as_dict(),
              "rows": rows,
              "summary": {f"speedup_batch_{r['batch']}": r["speedup"] for r in rows}
              | {f"engine_step_ms_batch_{r['batch']}": r["engine_step_ms"] for r in rows}}  # fmt: skip
    write_json(json_path, result)
    return result


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    model: Annotated[str, typer.Option(help="smollm2-135m-instruct (shipped weights), or a random smollm2-135m, "
                                            "qwen2.5-1.5b, qwen2.5-7b, toy.")] = "smollm2-135m-instruct",
    device: Device = "auto",
    dtype: Annotated[str | None, typer.Option(help="bfloat16 or float32 (default: bf16 on CUDA, fp32 on CPU).")] = None,
    batches: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,64",
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens each row samples.")] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per figure (the median is reported).")] = 3,
    threads: Annotated[int, typer.Option(min=0, help="torch threads on a CPU (0: torch's default). One by default: "
                                                     "on a shared 2-core VM two spinning OpenMP threads ran up to "
                                                     "10× slower (`rlbus bench engines`).")] = 1,
) -> None:
    """The torch engine against transformers.generate: tokens/s and decode step at batch 1 and 64."""
    from rlbus.models.device import announce

    if dtype is not None and dtype not in DTYPES:
        raise typer.BadParameter("--dtype is bfloat16 or float32")
    sizes = tuple(int(b) for b in batches.split(","))
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    where = str(announce(device, say=print).device)
    if torch.device(where).type == "cpu" and threads:
        torch.set_num_threads(threads)
    if quick:
        sizes, new_tokens, repeats = tuple(min(b, 8) for b in sizes), min(new_tokens, 16), 1
    run(model=model, batches=sizes, new_tokens=new_tokens, device=where, dtype=dtype, repeats=repeats,
        json_path=json_path)
