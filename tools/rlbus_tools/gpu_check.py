"""``make gpu-check``: every GPU-facing part of rlbus on one GPU, in one call of at most eight minutes, nothing
downloaded; one JSON out. ``--dry`` runs the same stages on the CPU at toy sizes (CI runs it: the test suite's
`tests/unit/tools/test_gpu_check.py`; the demo once, not per size).

Stages, in order of what matters most (each in its own process, so one's memory never crowds the next, each
under a time limit carved from what is left of the budget; a stage that no longer fits is reported
``skipped``):

1. ``tests`` — the CUDA tests (marker ``cuda``: captured decode graphs against the eager step, greedy against
   ``transformers.generate`` in bf16, host syncs per decode step on the GPU, FSDP2 on NCCL, the memory cap,
   the codec's CUDA path).
2. ``decode`` — `rlbus_tools.bench.decode`: the torch engine against ``transformers.generate`` at batch 1
   and 64 on SmolLM2-135M's architecture with random weights (bf16). Targets: ≥ 1.5× at batch 64,
   ≤ 10 ms a decode step at batch 1.
3. ``train`` — `rlbus_tools.bench.train` ``--size 1.5b``: the GRPO step on Qwen2.5-1.5B's configuration,
   bf16 over fp32 masters; tokens/s and MFU against the same run's measured GEMM peak. Target: MFU ≥ 30 %.
4. ``codec`` — ``rlbus bench codec --device cuda --state-gb 14`` (issue 42's flags: reported ``not
   available`` where this checkout's codec bench does not take them).
5. ``demo-*`` — a short ``rlbus demo`` (warm start, async GRPO, weight sync, evaluation) on random-weight
   models of SmolLM2's, Qwen2.5-1.5B's and Qwen2.5-7B's configurations (the 7 B shape with as many of its
   28 blocks as fit one GPU beside its trainer: `demo_layers`), saved as model directories first.

The JSON (``--json FILE``, default ``gpu-check.json``): the device, versions and commit; per stage its
status (``ok``, ``failed``, ``timed out``, ``skipped``, ``not available``), seconds, figures and the end of
its log; the targets and whether each was met.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: Test files that hold the CUDA tests (collected alone: the rest of the suite needs Kafka, Redis …).
CUDA_TESTS = (
    "tests/unit/engines/test_static_path.py", "tests/unit/engines/test_host_sync.py",
    "tests/unit/models/test_device.py", "tests/unit/training/test_nccl_fsdp.py", "tests/unit/weights/test_codec.py",
)


@dataclass(frozen=True)
class Stage:
    """One stage: its name, what it is given at most (seconds), and the least it needs to be worth starting."""

    name: str
    budget_s: float
    least_s: float


STAGES = (
    Stage("tests", 100, 30), Stage("decode", 110, 40), Stage("train", 100, 40), Stage("codec", 80, 30),
    Stage("demo-smollm2", 110, 50), Stage("demo-1.5b", 110, 60), Stage("demo-7b", 160, 90),
)
TOTAL_S = 470.0  # eight minutes less the margin for starting and writing


# --- the stages (each runs in a child process: `python -m rlbus_tools.gpu_check --stage NAME`) ------------


def stage_tests(dry: bool, work: Path) -> dict[str, Any]:
    import pytest

    report = work / "tests.xml"
    code = pytest.main(["-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={report}",
                        *(str(ROOT / f) for f in CUDA_TESTS)])  # fmt: skip
    counts = _junit(report)
    if code not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"pytest exited {int(code)}: {counts}")
    return counts


def _junit(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None
    get = lambda k: int(suite.get(k, 0))  # noqa: E731
    return {"tests": get("tests"), "failures": get("failures"), "errors": get("errors"), "skipped": get("skipped"),
            "passed": get("tests") - get("failures") - get("errors") - get("skipped")}


def stage_decode(dry: bool, work: Path) -> dict[str, Any]:
    from rlbus_tools.bench import decode

    if dry:
        return decode.run(model="toy", batches=(1, 4), new_tokens=8, device="cpu", repeats=1,
                          json_path=work / "decode.json")
    return decode.run(model="smollm2-135m", batches=(1, 64), new_tokens=64, device=_cuda(), repeats=3,
                      json_path=work / "decode.json")


def stage_train(dry: bool, work: Path) -> dict[str, Any]:
    from rlbus_tools import randmodels
    from rlbus_tools.bench import train

    if not dry:
        return train.run(device=_cuda(), size="1.5b", json_path=work / "train.json")
    size = train.Size("toy", train.dense_config(True), groups=2, group_size=2, prompt=8, completion=8, steps=1,
                      hf_config=randmodels.config("toy"))  # fmt: skip
    peak = train.matmul_peak("cpu", seconds=0.1)
    return {"matmul_peak": peak, "rows": [train.measure(size, replay=False, peak=peak["flops_per_s"])]}


def stage_codec(dry: bool, work: Path) -> dict[str, Any]:
    import typer

    from rlbus_tools.cli.bench import app

    out = work / "codec.json"
    args = ["codec", "--device", "cpu" if dry else "cuda", "--state-gb", "0.01" if dry else "14", "--json", str(out)]
    if dry:
        args.append("--quick")
    try:
        typer.main.get_command(app).main(args, prog_name="rlbus bench", standalone_mode=False)
    except Exception as exc:  # click's NoSuchOption (typer vendors click from 0.22 on: matched by name)
        if type(exc).__name__ != "NoSuchOption":
            raise
        return {"status": "not available", "why": f"rlbus bench codec: {exc}: issue 42's flags are not in this "
                                                  "checkout"}
    return json.loads(out.read_text()) if out.is_file() else {}


def demo_layers(gib: float) -> int:
    """How many of Qwen2.5-7B's 28 blocks a demo fits in ``gib`` of GPU memory: the trainer's fp32 master,
    gradients and AdamW moments (16 bytes a parameter), a rollout engine's and an evaluation's bf16 copies
    (2 each), and a quarter of the card left for activations, KV arenas and the allocator."""
    from rlbus_tools import randmodels

    usable = 0.75 * gib * 2**30
    for layers in range(28, 0, -1):
        if 20 * randmodels.params("qwen2.5-7b", layers=layers) <= usable:
            return layers
    return 1


def stage_demo(name: str, dry: bool, work: Path) -> dict[str, Any]:
    import asyncio
    import dataclasses

    import torch

    from rlbus.demo import Demo, demo_config
    from rlbus_tools import randmodels

    device = "cpu" if dry else _cuda()
    if dry:
        model, layers, workers, steps, group, warm = "toy", None, 1, 2, 2, 2
    elif name == "demo-smollm2":
        model, layers, workers, steps, group, warm = "smollm2-135m", None, 2, 8, 8, 10
    elif name == "demo-1.5b":
        model, layers, workers, steps, group, warm = "qwen2.5-1.5b", None, 1, 4, 8, 4
    else:
        free_gib = torch.cuda.mem_get_info()[1] / 2**30
        model, layers, workers, steps, group, warm = "qwen2.5-7b", demo_layers(free_gib), 1, 3, 4, 2
    t0 = time.perf_counter()
    directory = randmodels.save_dir(model, work / "models", device=device, layers=layers)
    saved_s = time.perf_counter() - t0
    config = demo_config(model=str(directory), steps=steps, workers=workers, time_budget_s=600.0, device=device)
    config = dataclasses.replace(config, eval_size=4 if dry else 16).tuned(
        trainer={"warm_steps": warm, "groups_per_step": 1 if dry else 2},
        task={"group_size": group, "env_config": {"digits": 2, "instructions": True, "max_new_tokens": 8 if dry else 24,
                                                  "context_tokens": 128, "max_total_tokens": 128}},
    )  # fmt: skip
    result = asyncio.run(Demo(config, work / f"run-{name}").run())
    return {"model": model, "layers": layers, "params": randmodels.params(model, layers=layers), "workers": workers,
            "save_s": saved_s, "figures": result.figures(),
            "steps_per_s": result.steps / result.wall_s if result.wall_s else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None}


def _cuda() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run `make gpu-check DRY=1` for the CPU rehearsal")
    return f"cuda:{torch.cuda.current_device()}"


RUNNERS: dict[str, Callable[[bool, Path], dict[str, Any]]] = {
    "tests": stage_tests, "decode": stage_decode, "train": stage_train, "codec": stage_codec,
    "demo-smollm2": lambda dry, w: stage_demo("demo-smollm2", dry, w),
    "demo-1.5b": lambda dry, w: stage_demo("demo-1.5b", dry, w),
    "demo-7b": lambda dry, w: stage_demo("demo-7b", dry, w),
}


# --- the parent: budget, child processes, targets, one JSON ------------------------------------------------


def run_stage(stage: Stage, dry: bool, work: Path, limit_s: float) -> dict[str, Any]:
    """``stage`` in a child process under ``limit_s`` (a dry run: in this process, sharing its imports): its
    status, seconds, figures and the end of its log."""
    if dry:
        return _in_process(stage, work)
    out = work / f"{stage.name}.result.json"
    cmd = [sys.executable, "-m", "rlbus_tools.gpu_check", "--stage", stage.name, "--work", str(work)]
    if dry:
        cmd.append("--dry")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s, env=env, check=False)
        status, log = ("ok" if proc.returncode == 0 else "failed"), proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status = "timed out"
        log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
    seconds = time.perf_counter() - t0
    figures = json.loads(out.read_text()) if status == "ok" and out.is_file() else None
    if isinstance(figures, dict) and figures.get("status") == "not available":
        status = "not available"
    return {"status": status, "seconds": seconds, "limit_s": limit_s, "figures": figures, "log_tail": log[-3000:]}


def _in_process(stage: Stage, work: Path) -> dict[str, Any]:
    import traceback

    t0 = time.perf_counter()
    try:
        figures: Any = json.loads(json.dumps(RUNNERS[stage.name](True, work), default=str))
        status, log = "ok", ""
    except Exception:
        figures, status, log = None, "failed", traceback.format_exc()
    if isinstance(figures, dict) and figures.get("status") == "not available":
        status = "not available"
    return {"status": status, "seconds": time.perf_counter() - t0, "figures": figures, "log_tail": log[-3000:]}


def targets(stages: dict[str, dict[str, Any]], dry: bool) -> dict[str, Any]:
    """Issue 41's GPU targets, from the figures (None where the stage gave none). A dry run has none."""
    if dry:
        return {}

    def figure(stage: str, *path: Any) -> Any:
        value: Any = stages.get(stage, {}).get("figures")
        for key in path:
            if not isinstance(value, dict | list):
                return None
            value = value[key] if isinstance(value, list) else value.get(key)
        return value

    rows = {r["batch"]: r for r in figure("decode", "rows") or []}
    speedup = rows.get(64, {}).get("speedup")
    step = rows.get(1, {}).get("engine_step_ms")
    mfu = figure("train", "summary", "mfu")
    return {
        "engine_speedup_batch_64": {"value": speedup, "target": ">= 1.5", "met": (speedup or 0) >= 1.5},
        "engine_step_ms_batch_1": {"value": step, "target": "<= 10", "met": step is not None and step <= 10},
        "trainer_mfu_1p5b": {"value": mfu, "target": ">= 0.30", "met": (mfu or 0) >= 0.30},
    }


def device_info() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": str(torch.__version__),
                            "cuda": torch.version.cuda, "gpu": None}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        from rlbus.models.device import describe

        info["gpu"] = describe(torch.device("cuda", torch.cuda.current_device())).as_dict()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    info["commit"] = commit.stdout.strip() or None
    return info


def check(dry: bool, json_path: Path, only: list[str] | None = None, total_s: float = TOTAL_S) -> dict[str, Any]:
    """Every stage within ``total_s``; writes and returns the JSON."""
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-gpu-check-") as tmp:
        work = Path(tmp)
        for stage in STAGES:
            if only and stage.name not in only:
                continue
            left = total_s - (time.perf_counter() - started)
            if dry and stage.name in ("demo-1.5b", "demo-7b"):
                results[stage.name] = {"status": "skipped", "why": "a dry run rehearses the demo once (demo-smollm2)"}
                continue
            if left < stage.least_s:
                results[stage.name] = {"status": "skipped", "why": f"{left:.0f} s left of {total_s:.0f}"}
                continue
            results[stage.name] = run_stage(stage, dry, work, min(stage.budget_s, left))
            print(f"gpu-check {stage.name}: {results[stage.name]['status']} "
                  f"({results[stage.name]['seconds']:.0f} s)", flush=True)
    result = {"check": "gpu", "dry": dry, "device": device_info(), "seconds": time.perf_counter() - started,
              "budget_s": total_s, "stages": results, "targets": targets(results, dry)}
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    _print_summary(result)
    return result


def _print_summary(result: dict[str, Any]) -> None:
    from rlbus_tools.bench.common import print_table

    print_table(f"gpu-check{' (dry, CPU)' if result['dry'] else ''}: {result['seconds']:.0f} s",
                ["stage", "status", "seconds"],
                [[name, r["status"], f"{r.get('seconds', 0):.0f}"] for name, r in result["stages"].items()])
    for name, t in result["targets"].items():
        print(f"target {name}: {t['value']} (want {t['target']}): {'met' if t['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlbus_tools.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the CPU rehearsal at toy sizes")
    parser.add_argument("--json", type=Path, default=Path("gpu-check.json"), help="where the figures go")
    parser.add_argument("--only", nargs="*", help="run only these stages")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a child: run one stage
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        figures = RUNNERS[args.stage](args.dry, args.work)
        (args.work / f"{args.stage}.result.json").write_text(json.dumps(figures, default=str))
        return 0
    result = check(args.dry, args.json, args.only)
    broken = [n for n, r in result["stages"].items() if r["status"] in ("failed", "timed out")]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
