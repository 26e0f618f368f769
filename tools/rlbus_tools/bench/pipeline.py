"""``rlbus bench pipeline``: asynchronous against synchronous RL — the same task, seed, weights and hardware.

Both modes run the embedded pipeline of ``rlbus demo`` (:class:`rlbus.demo.Demo`: prompt producer,
rollout workers with their own weight copies following deltas, the verifier reward worker, the trainer
joining rollouts with rewards) from one shared warm start:

* **sync** — prompts are admitted one batch per trainer version; each rollout worker waits until it
  serves that version before playing; the trainer trains only on rollouts of its current version. So
  the trainer waits for the whole batch (stragglers included) and generation pauses while it trains:
  the loop of a synchronous RLHF framework.
* **async** — everything runs continuously; admission control keeps rollouts at most ``max_staleness``
  versions behind (AReaL's bound); the trainer corrects the off-policy gap with its IS weights.

The trainer's weights are copied every ``snapshot_every`` steps with the time since RL started, and
every copy is evaluated after the run (greedy exact match, the demo's evaluation), so evaluation costs
neither mode any wall time. Reported per mode: wall time until the evaluated accuracy first reaches the
target, final accuracy, trainer and rollout-worker idle fractions, staleness mean/max, weight-sync bytes
per version, and steps per second. ``speedup`` = sync time-to-target / async time-to-target (``None``
when a mode never reaches the target), and ``throughput_speedup`` the ratio of steps per second.

Anchors for the speedup: AReaL 2.77× (Fu et al., 2025), verl 2.35–2.67× (its one-step-off-policy
recipe), PipelineRL ≈ 2× (Piché et al., 2025) — all on GPUs where generation dominates a step.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from rlbus.demo import Demo, DemoConfig, DemoResult, evaluate
from rlbus.models.policy import Policy
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json


def _staleness_stats(histogram: dict[int, int]) -> tuple[float, int]:
    total = sum(histogram.values())
    mean = sum(k * v for k, v in histogram.items()) / total if total else 0.0
    return mean, max(histogram, default=0)


def _figures(demo: Demo, result: DemoResult, curve: list[tuple[float, int, float]], target: float) -> dict[str, Any]:
    wall = demo.rl_wall_s
    busy = sum(m["step_s"] + m["publish_s"] for m in demo.step_metrics)
    active = [w.active_s for w in demo.rollout_workers]
    mean, worst = _staleness_stats(result.staleness)
    reached = next(((t, step) for t, step, acc in curve if acc >= target), None)
    return {
        "time_to_target_s": None if reached is None else round(reached[0], 2),
        "steps_to_target": None if reached is None else reached[1],
        "final_accuracy": result.accuracy_end,
        "accuracy_start": result.accuracy_start,
        "steps": result.steps,
        "rl_wall_s": round(wall, 2),
        "steps_per_s": round(result.steps / wall, 4) if wall else 0.0,
        "trainer_idle_fraction": round(max(0.0, 1 - busy / wall), 4) if wall else None,
        "rollout_idle_fraction": round(max(0.0, 1 - sum(active) / len(active) / wall), 4) if wall else None,
        "staleness_mean": round(mean, 3),
        "staleness_max": worst,
        "sync_bytes_per_version": round(result.delta_bytes_mean),
        "full_bytes": result.full_bytes,
        "rollouts_trained": result.rollouts_trained,
        "rollouts_dropped": result.rollouts_dropped,
        "accuracy_curve": [{"t": round(t, 2), "step": step, "accuracy": acc} for t, step, acc in curve],
    }


def run_mode(config: DemoConfig, warm: Policy, run_dir: Path, target: float) -> dict[str, Any]:
    """One mode from a copy of the warm-started ``warm``; returns its figures."""
    demo = Demo(config, run_dir)
    result = asyncio.run(demo.run(model=copy.deepcopy(warm)))
    prompts = demo.eval_prompts()
    curve = [(0.0, 0, result.accuracy_start)]
    for t, step, weights in demo.snapshots:
        model = copy.deepcopy(warm)
        model.load_state_dict(weights)
        curve.append((t, step, evaluate(model, prompts, demo.source)))
    return _figures(demo, result, curve, target)


def run(
    *, quick: bool = False, json_path: Path | None = None, modes: tuple[str, ...] = ("sync", "async"),
    target: float = 0.8, seed: int = 0,
) -> dict[str, Any]:
    """``seed`` seeds the warm start, the task stream and sampling (both modes share it)."""
    base = DemoConfig.quick() if quick else DemoConfig()
    base = dataclasses.replace(base, snapshot_every=2 if quick else 5, time_budget_s=1e9).tuned(task={"seed": seed})
    torch.manual_seed(base.seed)
    torch.set_num_threads(1)
    warm = Policy(base.run.model.options)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-pipeline-") as tmp:
        t0 = time.monotonic()
        Demo(base, Path(tmp)).warm_start(warm)
        warm_s = time.monotonic() - t0
        out: dict[str, Any] = {"meta": meta(), "config": {
            "env": base.run.task.env, "env_config": base.run.task.env_config, "workers": base.workers,
            "group_size": base.run.task.group_size, "groups_per_step": base.run.trainer.groups_per_step,
            "max_staleness": base.run.trainer.grpo.max_staleness, "rl_steps": base.rl_steps,
            "target_accuracy": target, "warm_start_s": round(warm_s, 1), "seed": base.seed,
        }}
        for mode in modes:
            config = dataclasses.replace(base, mode=mode)  # type: ignore[arg-type]
            out[mode] = run_mode(config, warm, Path(tmp) / mode, target)
    if "sync" in out and "async" in out:
        s, a = out["sync"], out["async"]
        out["speedup"] = (
            round(s["time_to_target_s"] / a["time_to_target_s"], 2)
            if s["time_to_target_s"] and a["time_to_target_s"] else None
        )
        out["throughput_speedup"] = round(a["steps_per_s"] / s["steps_per_s"], 2) if s["steps_per_s"] else None
    rows = [
        [mode, f["time_to_target_s"], f["steps_to_target"], f["final_accuracy"], f["steps_per_s"],
         f["trainer_idle_fraction"], f["rollout_idle_fraction"], f["staleness_mean"], f["staleness_max"],
         f["sync_bytes_per_version"]]
        for mode in modes if (f := out[mode])
    ]
    print_table(
        f"pipeline: time to {target:.0%} greedy accuracy (start {out[modes[0]]['accuracy_start']:.0%})",
        ["mode", "time to target s", "steps", "final acc", "steps/s", "trainer idle", "rollout idle",
         "staleness mean", "max", "sync bytes/version"],
        rows,
    )
    if "speedup" in out:
        print(f"speedup (time to target, sync/async): {out['speedup']}   throughput: {out['throughput_speedup']}×")
    if json_path is not None:
        write_json(json_path, out)
    return out


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    mode: Annotated[str | None, typer.Option(help="sync or async (default: both, and the speedup).")] = None,
    seed: Annotated[int, typer.Option(help="The seed; repeat runs to see the spread.")] = 0,
) -> None:
    """The demo's loop run synchronously and asynchronously: time to a target accuracy, the speedup."""
    if mode is not None and mode not in ("sync", "async"):
        raise typer.BadParameter("--mode is sync or async")
    run(quick=quick, json_path=json_path, seed=seed, modes=(mode,) if mode else ("sync", "async"))
