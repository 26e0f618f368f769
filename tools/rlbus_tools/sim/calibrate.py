"""A real run's log → the simulator's parameters, and the figures the simulator must reproduce.

:func:`measure` reads what every ``rlbus up`` run leaves in its run directory (:mod:`rlbus.observe.runlog`)
and returns two things kept strictly apart:

* **parameters** (a :class:`~rlbus_tools.sim.fleet.Fleet`): the trainer's step and publish times and the fixed
  overhead between steps, the per-sequence decode rate and the log-normal fit of sampled tokens per
  episode, the time outside decoding per episode, the stage rate and swap pause of weight syncs, delta and
  keyframe sizes, and the run config's settings (workers, group size, groups per step, ``max_staleness``,
  admission). These are per-event measurements; none is one of the figures below.
* **figures** the run achieved: trained rollouts per minute, mean staleness, the stale-dropped share and
  the mean publish → swapped sync lag. The simulator, fed only the parameters, predicts these
  (``rlbus bench sim-calibration`` compares them).

Both count from the run's first trainer step to its last (start-up — model loading, the consumer group's
first rebalance — is not what the simulator models).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.errors import RunLogMissing
from rlbus.launch.config import RunConfig
from rlbus.launch.roles import JOIN_EXPIRE_EVERY_S
from rlbus.observe.runlog import COMPLETIONS, PROMPTS, STEPS, WEIGHTS, read
from rlbus.observe.stats import percentile
from rlbus_tools.sim.fleet import Fleet, fleet_from_dict

#: The figures a calibration compares, and the floor under each one's denominator: a relative error
#: against 0 is undefined, so a figure whose measured value is below its floor is compared as if it were
#: the floor (a stale-dropped share of 0 measured and 1 % predicted is a 20 % error, not an infinite one).
FIGURES: dict[str, float] = {
    "trained_rollouts_per_min": 1.0,
    "staleness_mean_versions": 0.25,
    "stale_drop_fraction": 0.05,
    "sync_lag_mean_s": 0.05,
}


@dataclass
class Measured:
    fleet: Fleet
    figures: dict[str, float]
    #: the parameters as read, for the report (rates, fits, counts)
    parameters: dict[str, Any]


def _files(run_dir: Path, prefix: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(run_dir / f"{prefix}-*.jsonl")))


def _lines(path: Path) -> list[dict[str, Any]]:
    return list(read(path.parent, path.name.removesuffix(".jsonl")))


def measure(run_dir: str | Path, config: RunConfig, *, workers: int) -> Measured:
    """Parameters and figures of the run in ``run_dir`` (``config``: its run config; ``workers``: the
    rollout workers ``rlbus up`` started)."""
    run_dir = Path(run_dir)
    steps = list(read(run_dir, STEPS))
    weights = list(read(run_dir, WEIGHTS))
    if len(steps) < 3 or not weights:
        raise RunLogMissing(f"{run_dir}: fewer than 3 trainer steps or no published version to calibrate from")
    rollouts = [line for path in _files(run_dir, "rollouts") for line in _lines(path)]
    syncs = [line for path in _files(run_dir, "syncs") for line in _lines(path)]
    if not rollouts or not syncs:
        raise RunLogMissing(f"{run_dir}: no rollouts-*.jsonl or syncs-*.jsonl (rollout workers' run log)")
    t0 = steps[0]["t"]
    window = steps[-1]["t"] - t0
    counted = steps[1:]

    # --- figures ---------------------------------------------------------------------------------------
    trained = sum(int(s.get("rollouts", 0)) for s in counted)
    # stale rollouts are dropped before the step sees them; each step's line carries those since the last
    stale = sum(int(s.get("dropped_stale", 0)) + int(s.get("stale_dropped", 0)) for s in counted)
    histogram: dict[int, int] = {}
    for s in counted:
        for k, v in (s.get("staleness") or {}).items():
            histogram[int(k)] = histogram.get(int(k), 0) + int(v)
    published = {int(w["version"]): float(w["t"]) for w in weights}
    lags = [float(x["lag_s"]) for x in syncs if x.get("kind") == "delta" and published.get(int(x["version"]), 0) >= t0]
    figures = {
        "trained_rollouts_per_min": trained / window * 60 if window > 0 else 0.0,
        "staleness_mean_versions": sum(k * v for k, v in histogram.items()) / max(1, sum(histogram.values())),
        "stale_drop_fraction": stale / (stale + trained) if stale + trained else 0.0,
        "sync_lag_mean_s": statistics.fmean(lags) if lags else 0.0,
    }

    # --- parameters ------------------------------------------------------------------------------------
    step_s = [float(s["step_s"]) for s in counted]
    publish_s = [float(s.get("publish_s", 0.0)) + float(s.get("checkpoint_s", 0.0)) for s in counted]
    overhead = _step_overhead_s(run_dir, steps)
    sampled = [max(1, int(r["sampled_tokens"])) for r in rollouts]
    generate = [float(r["timings"].get("generate", 0.0)) for r in rollouts]
    outside = [
        max(0.0, float(r["timings"].get("total", 0.0)) - float(r["timings"].get("generate", 0.0))) for r in rollouts
    ]
    rate = sum(sampled) / max(1e-9, sum(generate))  # tokens/s of one sequence at the run's concurrency
    logs = [math.log(n) for n in sampled]
    deltas = [w for w in weights if w.get("kind") == "delta"]
    full = float(weights[0]["full_bytes"])
    keyframe = float(next((w["keyframe_bytes"] for w in weights if w.get("keyframe_bytes")), 0.674 * full))
    delta_bytes = statistics.fmean(float(w["delta_bytes"]) for w in deltas) if deltas else 0.01 * full
    stage = [x for x in syncs if x.get("kind") == "delta"]
    stage_rate = (
        sum(float(x["bytes_fetched"]) for x in stage) / max(1e-9, sum(float(x["stage_s"]) for x in stage))
        if stage
        else 1e9
    )
    hop = _bus_hop_s(syncs)
    admit_s = _admit_s(run_dir)
    reaction = _admission_reaction_s(run_dir, syncs)
    prompt_hops, join_trips = _pipeline_hops_s(run_dir, rollouts, steps, config.rollout.prompts_in_flight)
    prompt_s = statistics.median(prompt_hops) if prompt_hops else 0.02
    join_s = statistics.median(join_trips) if join_trips else 0.04
    g = config.task.group_size
    in_flight = config.rollout.prompts_in_flight
    step_mean = statistics.fmean(step_s)
    data = {
        "sim": {"duration_s": window + 1.0, "warmup_s": 0.0, "sync_baseline": False},
        "model": {
            "params": full / 2,
            "bytes_per_param": 2.0,
            **run_settings(config)["model"],
            "delta_fraction": delta_bytes / full,
            "keyframe_fraction": keyframe / full,
            "decode_bytes_per_s": stage_rate,
            "swap_pause_s": statistics.fmean(float(x["swap_pause_s"]) for x in stage) if stage else 0.0,
            "stage_samples": [round(float(x["stage_s"]) + float(x.get("verify_s", 0.0)), 5) for x in stage] or None,
        },
        "trainer": {
            "step_s": step_mean + overhead,
            "step_cv": statistics.pstdev(step_s) / step_mean if step_mean else 0.0,
            "world_size": 1,
            "encode_bytes_per_s": full / max(1e-6, statistics.fmean(publish_s)),
            "egress_gbps": 1000.0,
            **run_settings(config)["trainer"],
            "publish_latency_s": hop,
            "counter_delay_s": reaction,
            "release_every_s": JOIN_EXPIRE_EVERY_S,
        },
        "episode": {
            "tokens_median": math.exp(statistics.fmean(logs)),
            "tokens_sigma": statistics.pstdev(logs),
            "max_tokens": max(sampled),
            "turns": 1,
            "tool_s": 0.0,
            "setup_s": statistics.fmean(outside),
        },
        "reward": {"workers": max(1, config.reward.concurrency), "verifier_s": 0.0},
        "bus": {
            "latency_s": hop,
            "producer_poll_s": 0.0,
            "admit_s": admit_s,
            "prompt_s": prompt_s,
            "join_s": join_s,
            "prompt_samples": [round(x, 5) for x in prompt_hops] or None,
            "join_samples": [round(x, 5) for x in join_trips] or None,
            "heartbeat_s": config.run.heartbeat_s,
        },
        "region": _region_sections(run_dir, workers, {
            "tokens_per_s": rate * in_flight * g, "concurrency": in_flight * g, "groups_in_flight": in_flight,
        }),
    }
    parameters = {
        "step_s": round(step_mean, 4),
        "step_overhead_s": round(overhead, 4),
        "publish_s": round(statistics.fmean(publish_s), 4),
        "decode_tokens_per_s_per_sequence": round(rate, 2),
        "sampled_tokens_median": round(math.exp(statistics.fmean(logs)), 2),
        "sampled_tokens_sigma": round(statistics.pstdev(logs), 4),
        "episode_outside_decode_s": round(statistics.fmean(outside), 4),
        "stage_bytes_per_s": round(stage_rate),
        "delta_bytes_mean": round(delta_bytes),
        "bus_hop_s": round(hop, 4), "admit_s": round(admit_s, 4),
        "admission_reaction_s": round(reaction, 4),
        "prompt_hop_s_median": round(prompt_s, 4),
        "prompt_hops": len(prompt_hops),
        "join_trip_s_median": round(join_s, 4),
        "join_trips": len(join_trips),
        "rollouts_measured": len(rollouts),
        "steps": len(steps),
        "window_s": round(window, 3),
    }
    return Measured(fleet=fleet_from_dict(data), figures=figures, parameters=parameters)


def _step_overhead_s(run_dir: Path, steps: list[dict[str, Any]]) -> float:
    """The trainer's own time per step outside the step and the publish (the ledger's writes, the run log,
    its consumer loop): from the end of the previous step, or from its last group completing in the join
    when that came later, to the step's start — the smallest such time over the run, so that the join's
    release timer (modelled on its own) adds as little as possible; the median over steps whose groups were
    all complete before the previous step ended when there are three or more of those (they waited for
    nothing)."""
    completed = {int(line["step"]): list(line["completed_at"].values()) for line in read(run_dir, COMPLETIONS)}
    idle, ready = [], []
    for a, b in itertools.pairwise(steps):
        begin = b["t"] - float(b["step_s"]) - float(b.get("publish_s", 0.0)) - float(b.get("checkpoint_s", 0.0))
        done = [c for c in completed.get(int(b["step"]), []) if c is not None]
        if not done:
            continue
        idle.append(begin - max(a["t"], max(done)))
        if max(done) < a["t"]:
            ready.append(begin - a["t"])
    if len(ready) >= 3:
        return max(0.0, statistics.median(ready))
    return max(0.0, min(idle)) if idle else 0.0


def run_settings(config: RunConfig) -> dict[str, dict[str, Any]]:
    """The fleet fields a run config decides (``rlbus sim --config`` lays them over the fleet file; a
    calibration takes them from the run it measures): groups per step, G, versions, the staleness bound and
    admission, the learning rate the delta sizes follow, the keyframe cadence."""
    t = config.trainer
    return {
        "trainer": {"groups_per_step": t.groups_per_step, "group_size": config.task.group_size,
                    "publish_every": t.publish_every, "max_staleness": t.grpo.max_staleness,
                    "admission": t.admission, "slack": t.admission_slack},
        "model": {"lr": t.lr, "keyframe_every": t.keyframe_every},
    }


def with_run_config(fleet: Fleet, config: RunConfig) -> Fleet:
    """``fleet`` with the run config's settings (:func:`run_settings`) in place of its own."""
    data = fleet.to_dict()
    for table, fields in run_settings(config).items():
        data[table] = {**data[table], **fields}
    return fleet_from_dict(data)


def _admit_s(run_dir: Path) -> float:
    """The producer's time per admitted prompt: the median gap between consecutive prompts admitted at the
    same version (one burst when a window opens)."""
    prompts = list(read(run_dir, PROMPTS))
    gaps = [float(b["created_at"]) - float(a["created_at"])
            for a, b in itertools.pairwise(prompts) if a["version"] == b["version"]]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def _region_sections(run_dir: Path, workers: int, per_worker: dict[str, Any]) -> list[dict[str, Any]]:
    """The fleet's regions: those of the run's ``wan.json`` (written by ``rlbus bench regions``: each region's
    workers, its link to the trainer's region and whether it had a relay), else one LAN region per worker."""
    topology = run_dir / "wan.json"
    if not topology.is_file():
        return [{"name": f"worker-{i}", "workers": 1, **per_worker, "wan_gbps": 10.0, "wan_latency_ms": 0.0,
                 "relay": False} for i in range(workers)]
    regions = json.loads(topology.read_text())["regions"]
    return [{"name": str(r["name"]), "workers": int(r["workers"]), **per_worker, "wan_gbps": float(r["wan_gbps"]),
             "wan_latency_ms": float(r["wan_latency_ms"]), "relay": bool(r["relay"])}
            for r in regions if int(r["workers"]) > 0]


def _bus_hop_s(syncs: list[dict[str, Any]]) -> float:
    """One produce → consume hop: the median time from a version's manifest to a worker starting to stage
    it (its sync lag less staging, verifying and the swap), the one hop every run log times directly."""
    hops = sorted(
        float(x["lag_s"]) - float(x["stage_s"]) - float(x.get("verify_s", 0.0)) - float(x["swap_pause_s"])
        for x in syncs
        if x.get("kind") == "delta"
    )
    return max(0.0, percentile(hops, 50)) if hops else 0.02


def _admission_reaction_s(run_dir: Path, syncs: list[dict[str, Any]]) -> float:
    """Manifest → admission acting on the new version: the first prompt admitted at version v less the
    moment v's manifest was made (the workers' sync records carry it), median over versions. It holds the
    ledger's writes, the counters' update and the producer's poll."""
    made: dict[int, float] = {}
    for x in syncs:
        if x.get("manifest_at"):
            made.setdefault(int(x["version"]), float(x["manifest_at"]))
    first: dict[int, float] = {}
    for line in read(run_dir, PROMPTS):
        first.setdefault(int(line["version"]), float(line["created_at"]))
    delays = [first[v] - made[v] for v in first if v in made and v > 1]
    return max(0.0, statistics.median(delays)) if delays else 0.05


def _pipeline_hops_s(
    run_dir: Path, rollouts: list[dict[str, Any]], steps: list[dict[str, Any]], slots: int
) -> tuple[list[float], list[float]]:
    """The prompt hop (admitted → a worker starts the group, over the prompts whose worker had a free slot:
    ``slots`` groups play at once) and the join trip (a group's last rollout → the trainer's join holding
    the group complete: the rewards' hop and the join's own reads; the in-order release after it is
    modelled), as measured samples: both are bimodal on a busy machine (a fetch that returns at once, or one
    that waits out the event loop's turn), which no two-parameter fit keeps."""
    admitted = {line["prompt_id"]: float(line["created_at"]) for line in read(run_dir, PROMPTS)}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rollouts:
        groups.setdefault(r["prompt_id"], []).append(r)
    first_step = float(steps[0]["t"])  # start-up (workers joining the group) is not a hop
    spans = {
        pid: (
            min(float(r["created_at"]) - float(r["timings"].get("total", 0.0)) for r in rs),
            max(float(r["created_at"]) for r in rs),
            rs[0]["worker"],
        )
        for pid, rs in groups.items()
    }
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for start, end, worker in spans.values():
        by_worker.setdefault(worker, []).append((start, end))
    waits = []
    for pid, (start, _, worker) in spans.items():
        at = admitted.get(pid)
        # only prompts whose worker had a free slot when they were admitted: the hop, not a queue
        if at is not None and at >= first_step and sum(s <= at < e for s, e in by_worker[worker]) < slots:
            waits.append(max(1e-4, start - at))
    trips: list[float] = []
    for line in read(run_dir, COMPLETIONS):
        for pid, completed in line["completed_at"].items():
            if pid in spans:
                trips.append(float(completed) - spans[pid][1])
    return sorted(waits), sorted(x for x in trips if x > 0)


def relative_error(predicted: float | None, measured: float, floor: float) -> float:
    """|predicted − measured| / max(|measured|, floor); a missing prediction is an error of 1."""
    if predicted is None:
        return 1.0
    return abs(predicted - measured) / max(abs(measured), floor)


def to_dict(measured: Measured) -> dict[str, Any]:
    return {"figures": measured.figures, "parameters": measured.parameters, "fleet": measured.fleet.to_dict()}
