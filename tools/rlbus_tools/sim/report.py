"""A simulated run's figures (the JSON ``rlbus sim`` writes), its table and its plots.

Every rate, share and distribution counts from the first trainer step after ``[sim] warmup_s`` to the end
(start-up — the first keyframe reaching every region, the pipeline filling — is not steady state).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.observe.stats import percentile

if TYPE_CHECKING:
    from rlbus_tools.sim.model import Simulation


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(sorted(values), q), 4) if values else None


def _time_mean(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """The time average of a step function given as (time, value) changes, over [start, end]."""
    total, value, last = 0.0, 0.0, start
    for t, v in samples:
        if t > start:
            total += value * (min(t, end) - last)
            last = min(t, end)
        value = v
        if t >= end:
            break
    total += value * (end - last)
    return total / (end - start) if end > start else 0.0


def figures(sim: Simulation) -> dict[str, Any]:
    """What one run of the model measured (keys documented in docs/simulator.md)."""
    st, f = sim.stats, sim.fleet
    end = sim.env.now
    start = st.window_start if st.window_start is not None else end
    window = max(end - start, 1e-9)
    steps = [s for s in st.steps if s["t"] > start]
    rollouts = sum(s["rollouts"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    stale = sum(s["dropped"] for s in steps)
    histogram = dict(sorted(st.staleness.items()))
    counted = sum(histogram.values())
    versions = [v for v, t in st.publishes.items() if t >= start]
    # publish → swapped: per worker and version, per region (every worker) and all regions
    worker_lag: dict[str, list[float]] = {r: [] for r in sim.regions}
    for name, swaps in st.swaps.items():
        region = st.worker_region[name]
        worker_lag[region] += [t - st.publishes[v] for v, t in swaps.items() if v in versions]
    region_lag = {
        r: [st.region_swapped[r][v] - st.publishes[v] for v in versions if v in st.region_swapped[r]]
        for r in sim.regions
    }
    everywhere = [
        max(st.region_swapped[r][v] for r in sim.regions) - st.publishes[v]
        for v in versions
        if all(v in st.region_swapped[r] for r in sim.regions)
    ]
    slots = _time_mean([(t, s) for t, _, s in st.fleet], start, end)
    delta_versions = [v for v in versions if v > 1]
    wan = {r: _mean([st.wan_bytes[r].get(v, 0.0) for v in delta_versions]) for r in sim.regions}
    full = f.model.full_bytes
    in_system = _time_mean(st.in_system, start, end)
    version_s = window / len(versions) if versions else None
    summary = {
        "trained_rollouts_per_min": round(rollouts / window * 60, 3),
        "trained_tokens_per_s": round(tokens / window, 3),
        "steps": len([s for s in steps if s["rollouts"]]),
        "versions": len(versions),
        "version_interval_s": round(version_s, 3) if version_s else None,
        "staleness_mean_versions": round(sum(k * v for k, v in histogram.items()) / counted, 4) if counted else None,
        "stale_drop_fraction": round(stale / (stale + rollouts), 4) if stale + rollouts else 0.0,
        "sync_lag_mean_s": _mean([x for lags in worker_lag.values() for x in lags]),
        "publish_to_all_swapped_s_p50": _pct(everywhere, 50),
        "publish_to_all_swapped_s_p99": _pct(everywhere, 99),
        "delta_transfer_s_by_region": {r: _mean(st.delta_transfer_s[r]) for r in sim.regions},
        "full_snapshot_transfer_s_by_region": {
            r: round(sim._wan_s(sim.regions[r], full * f.model.keyframe_fraction), 3) for r in sim.regions
        },
        "wan_bytes_per_version_by_region": wan,
        "in_system_groups_mean": round(in_system, 3),
        "utilisation": {
            "trainer": round(st.trainer_busy_s / window, 4),
            "rollout_slots": round(st.slot_busy_s / (slots * window), 4) if slots else None,
            "reward": round(st.reward_busy_s / (f.reward.workers * window), 4),
        },
        "dropped_rollouts": {"stale": stale, "redelivered_after_loss": st.redelivered},
        "wasted_generation_slot_s": round(st.wasted_gen_s, 3),
        "lost_groups": sim.admitted - sim.groups_taken - sim.located(),
    }
    return {
        "mode": sim.mode,
        "window_s": [round(start, 3), round(end, 3)],
        "summary": summary,
        "staleness_histogram": {str(k): v for k, v in histogram.items()},
        "sync_lag_s_by_region": {
            r: {"mean": _mean(worker_lag[r]), "p50": _pct(worker_lag[r], 50), "p99": _pct(worker_lag[r], 99)}
            for r in sim.regions
        },
        "region_swapped_s_by_region": {
            r: {"p50": _pct(region_lag[r], 50), "p99": _pct(region_lag[r], 99)} for r in sim.regions
        },
        "fleet_size": [[round(t, 1), n] for t, n, _ in st.fleet[:: max(1, len(st.fleet) // 500)]],
        "swap_times": {
            r: [
                [v, round(st.region_swapped[r][v] - st.publishes[v], 3)]
                for v in sorted(st.region_swapped[r])
                if v in st.publishes
            ]
            for r in sim.regions
        },
    }


def closed_form_staleness(
    in_system_groups: float, groups_per_version: int, sync_lag_s: float, version_interval_s: float
) -> float:
    """Mean staleness from Little's law, the form Applied Compute's analysis of fully asynchronous RL
    takes ("Predicting and Controlling Staleness in Fully Asynchronous RL Training", 2026: staleness is set
    by utilisation, batch size, queue capacity and rollout concurrency).

    With the trainer saturated and groups trained in prompt order, a group spends W = L / λ between
    admission and training, where L is the mean number of admitted, untrained groups and λ = B / T the
    trainer's rate (B groups per version, a version every T seconds); the versions published meanwhile are
    W / T = L / B. The weights it started on were already ``sync_lag`` behind the trainer, which adds
    ``sync_lag / T``: E[staleness] ≈ L / B + lag / T. It does not hold when the trainer idles (rollout-bound:
    groups wait for workers, not for the trainer) or when the join reorders."""
    return in_system_groups / groups_per_version + sync_lag_s / version_interval_s


def table_rows(results: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of the scenarios' table: one row per scenario (swap: publish → every region swapped, s;
    slots, trainer: busy shares; redeliv: rollouts redelivered after a worker was lost)."""
    columns = ["scenario", "tok/s", "roll/min", "stale", "drop %", "swap p50", "p99", "slots", "trainer", "redeliv"]
    rows = []
    for name, result in results.items():
        s = result["summary"]
        rows.append(
            [
                name,
                _fmt(s["trained_tokens_per_s"]),
                _fmt(s["trained_rollouts_per_min"]),
                _fmt(s["staleness_mean_versions"]),
                _fmt(100 * s["stale_drop_fraction"]),
                _fmt(s["publish_to_all_swapped_s_p50"]),
                _fmt(s["publish_to_all_swapped_s_p99"]),
                _fmt(s["utilisation"]["rollout_slots"]),
                _fmt(s["utilisation"]["trainer"]),
                s["dropped_rollouts"]["redelivered_after_loss"],
            ]
        )
    return columns, rows


def region_rows(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Per region of one scenario: WAN transfer of a delta and of a full snapshot, WAN bytes per version,
    publish → swapped (every worker of the region)."""
    s = result["summary"]
    columns = ["region", "delta over WAN s", "full snapshot s", "WAN GB/version", "swapped p50 s", "swapped p99 s"]
    rows = []
    for region in s["delta_transfer_s_by_region"]:
        wan = s["wan_bytes_per_version_by_region"].get(region)
        swapped = result["region_swapped_s_by_region"][region]
        rows.append(
            [
                region,
                _fmt(s["delta_transfer_s_by_region"][region]),
                _fmt(s["full_snapshot_transfer_s_by_region"][region]),
                _fmt(None if wan is None else wan / 1e9),
                _fmt(swapped["p50"]),
                _fmt(swapped["p99"]),
            ]
        )
    return columns, rows


def print_tables(result: dict[str, Any]) -> None:
    """The scenarios' table, the async run's per-region table and the headline line (``rlbus sim``)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))  # ten columns: wider than a pipe's default 80
    for title, (columns, rows) in (("rlbus sim", table_rows(result["scenarios"])),
                                   ("per region (async)", region_rows(result["scenarios"]["async"]))):
        table = Table(title=title)
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            table.add_row(*[str(v) for v in row])
        console.print(table)
    summary = result["summary"]
    console.print(f"async vs sync speedup: {summary['async_vs_sync_speedup']}×; mean staleness "
                  f"{summary['staleness_mean_versions']} (Little's-law closed form {summary['staleness_closed_form']}, "
                  f"trainer busy {summary['trainer_busy']})")


def _fmt(value: Any) -> Any:
    """Short cells: 3 significant figures below 100, whole numbers above."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return value


def plot(results: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG plots: staleness histograms, publish → region swapped per version, trained tokens/s and
    utilisation per scenario. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names = list(results)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        hist = {int(k): v for k, v in results[name]["staleness_histogram"].items()}
        total = sum(hist.values()) or 1
        ax.bar([k + i * width for k in hist], [v / total for v in hist.values()], width=width, label=name)
    ax.set_xlabel("staleness (versions)")
    ax.set_ylabel("share of trained rollouts")
    ax.set_title("Staleness of trained rollouts")
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "staleness.png"))

    shown = [n for n in (names[0], "region-down") if n in results]
    fig, axes = plt.subplots(1, len(shown), figsize=(7 * len(shown), 4), squeeze=False)
    for ax, name in zip(axes[0], shown, strict=True):
        for region, points in results[name]["swap_times"].items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=region)
        ax.set_yscale("log")
        ax.set_xlabel("version (v1: the first keyframe)")
        ax.set_ylabel("publish → every worker swapped (s)")
        ax.set_title(f"Weight sync per region ({name})")
        ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "sync_by_region.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.barh(names, [results[n]["summary"]["trained_tokens_per_s"] for n in names])
    left.set_xlabel("trained tokens/s")
    tiers = ("rollout_slots", "trainer", "reward")
    for i, tier in enumerate(tiers):
        right.barh(
            [j + i * 0.27 for j in range(len(names))],
            [results[n]["summary"]["utilisation"][tier] or 0 for n in names],
            height=0.27,
            label=tier,
        )
    right.set_yticks(range(len(names)), names)
    right.set_xlabel("busy share")
    right.legend(fontsize=7)
    fig.suptitle("Throughput and utilisation per scenario")
    written.append(_save(fig, out_dir / "throughput.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
