"""``rlbus report RUN_DIR``: PNG plots and a short markdown summary of a run, from its run log.

Reads the files :mod:`rlbus.observe.runlog` describes — ``steps.jsonl`` (required: the trainer's step
metrics), and when present ``weights.jsonl``, ``syncs-*.jsonl``, ``rewards.jsonl`` and ``summary.json``
— and writes into the run directory (or ``out``):

==================  ===========================================================================
``reward.png``      mean reward per trainer step, and per reward source when rewards were logged
``staleness.png``   versions each trained rollout lagged the trainer (summed step histograms)
``sync_bytes.png``  bytes of each version's delta (and keyframes) against the full weights
``swap_pauses.png`` generation pause per applied version, per rollout worker
``mismatch.png``    KL(behaviour‖trainer) k3 and max |Δ log-prob|; IS-weight ESS and router flips
``report.md``       headline figures, outcome counts (from ``summary.json``) and the plots
==================  ===========================================================================

The chart-drawing functions (``draw_*``) take a matplotlib Axes and plain numbers, so ``rlbus demo``
draws its end-of-run figure with the same code (:func:`rlbus.demo_view.plot`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.errors import RunLogMissing
from rlbus.observe.runlog import REWARDS, STEPS, WEIGHTS, read, read_all_syncs
from rlbus.observe.stats import percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PLOTS = ("reward.png", "staleness.png", "sync_bytes.png", "swap_pauses.png", "mismatch.png")


# --- the data ---------------------------------------------------------------------------------------------
@dataclass
class RunData:
    """A run log read back: every event list in file order, and ``summary.json`` when it exists."""

    run_dir: Path
    steps: list[dict[str, Any]]
    weights: list[dict[str, Any]] = field(default_factory=list)
    syncs: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        """Read ``run_dir``; raises `RunLogMissing` naming the file when there is no run log."""
        import json

        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise RunLogMissing(f"{run_dir}: no such run directory")
        steps_file = run_dir / f"{STEPS}.jsonl"
        if not steps_file.exists():
            raise RunLogMissing(
                f"{steps_file} not found: {run_dir} holds no run log (the trainer writes {STEPS}.jsonl)"
            )
        summary_file = run_dir / "summary.json"
        return cls(
            run_dir=run_dir,
            steps=list(read(run_dir, STEPS)),
            weights=list(read(run_dir, WEIGHTS)),
            syncs=list(read_all_syncs(run_dir)),
            rewards=list(read(run_dir, REWARDS)),
            summary=json.loads(summary_file.read_text()) if summary_file.exists() else None,
        )

    @property
    def t0(self) -> float:
        """The first event's time: plots count seconds from here."""
        times = [e["t"] for events in (self.steps, self.weights, self.syncs, self.rewards) for e in events if "t" in e]
        return min(times, default=0.0)

    def staleness(self) -> dict[int, int]:
        return merge_histograms(s.get("staleness") or {} for s in self.steps)

    def reward_points(self) -> list[tuple[float, float]]:
        return [(s["t"] - self.t0, s["reward_mean"]) for s in self.steps if _num(s.get("reward_mean"))]

    def rewards_by_source(self) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for r in self.rewards:
            if _num(r.get("value")):
                out.setdefault(str(r.get("source", "unknown")), []).append((r["t"] - self.t0, float(r["value"])))
        return out

    def deltas(self) -> list[tuple[int, int]]:
        return [(w["version"], w["delta_bytes"]) for w in self.weights if w.get("delta_bytes")]

    def keyframes(self) -> list[tuple[int, int]]:
        return [(w["version"], w["keyframe_bytes"]) for w in self.weights if w.get("keyframe_bytes")]

    def full_bytes(self) -> int:
        return max((int(w.get("full_bytes") or 0) for w in self.weights), default=0)

    def pauses_by_worker(self) -> dict[str, list[tuple[int, float]]]:
        out: dict[str, list[tuple[int, float]]] = {}
        for s in self.syncs:
            if _num(s.get("swap_pause_s")):
                out.setdefault(str(s.get("worker", "?")), []).append((s["version"], s["swap_pause_s"] * 1000))
        return out


def merge_histograms(histograms: Iterable[Mapping[Any, int]]) -> dict[int, int]:
    """Sum {versions behind: count} histograms whose keys may be ints or (from JSON) strings."""
    total: dict[int, int] = {}
    for histogram in histograms:
        for k, v in histogram.items():
            total[int(k)] = total.get(int(k), 0) + int(v)
    return dict(sorted(total.items()))


def _num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- the charts (shared with the demo's figure) ----------------------------------------------------------
def draw_reward(
    ax: Axes,
    points: Sequence[tuple[float, float]],
    by_source: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> None:
    """Mean reward per trainer step against seconds since the start; per source as a binned mean."""
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", lw=1, label="trainer step mean")
    for source, pts in sorted((by_source or {}).items()):
        binned = _bin_means(pts, bins=40)
        ax.plot([p[0] for p in binned], [p[1] for p in binned], lw=1, alpha=0.8, label=f"{source} (binned)")
    ax.set(title="mean reward per trainer step", xlabel="seconds since start", ylabel="reward")


def draw_staleness(ax: Axes, histogram: Mapping[int, int]) -> None:
    lags = sorted(histogram)
    ax.bar([str(k) for k in lags], [histogram[k] for k in lags], color="tab:orange")
    ax.set(title="staleness of trained rollouts", xlabel="versions behind the trainer", ylabel="rollouts")


def draw_bytes(
    ax: Axes, deltas: Sequence[tuple[int, int]], full_bytes: int, keyframes: Sequence[tuple[int, int]] = ()
) -> None:
    """Delta bytes per version as bars, keyframes as markers, the full inference-dtype size as a line."""
    ax.bar([v for v, _ in deltas], [b / 1e3 for _, b in deltas], label="delta (lossless)")
    if keyframes:
        ax.scatter([v for v, _ in keyframes], [b / 1e3 for _, b in keyframes], marker="s", c="tab:orange",
                   label="keyframe", zorder=3)
    ax.axhline(full_bytes / 1e3, c="red", lw=1, label="full bf16 weights")
    ax.set(title="bytes shipped per version", xlabel="version", ylabel="kB", yscale="log")
    _integer_x(ax)
    ax.legend(fontsize=8)


def draw_swap_pauses(ax: Axes, by_worker: Mapping[str, Sequence[tuple[int, float]]]) -> None:
    every = [ms for pts in by_worker.values() for _, ms in pts]
    for worker, pts in sorted(by_worker.items()):
        ax.scatter([v for v, _ in pts], [ms for _, ms in pts], s=14, alpha=0.8, label=worker)
    title = "swap pause per applied version"
    if every:
        title += f" (p50 {percentile(every, 50):.2f} ms, p99 {percentile(every, 99):.2f} ms)"
    ax.set(title=title, xlabel="version", ylabel="pause (ms)")
    _integer_x(ax)
    ax.set_ylim(bottom=0)
    _legend(ax)


def draw_mismatch(ax: Axes, steps: Sequence[Mapping[str, Any]]) -> None:
    """KL(behaviour‖trainer) k3 and max |Δ log-prob| per step, log scale (they span decades)."""
    for key, label in (("kl_k3", "KL(behaviour‖trainer), k3"), ("max_abs_dlogprob", "max |Δ log-prob|")):
        pts = [(s["step"], s[key]) for s in steps if _num(s.get(key)) and s[key] > 0]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1, label=label)
    ax.set(title="trainer ↔ engine mismatch", xlabel="trainer step", ylabel="nats", yscale="log")
    _integer_x(ax)
    _legend(ax)


def draw_correction(ax: Axes, steps: Sequence[Mapping[str, Any]]) -> None:
    """IS-weight effective sample size and MoE router-flip rate per step, both fractions."""
    for key, label in (("is_ess", "IS-weight ESS / N"), ("router_flip_rate", "router-flip rate")):
        pts = [(s["step"], s[key]) for s in steps if _num(s.get(key))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1, label=label)
    ax.set(title="importance weights and routing", xlabel="trainer step", ylabel="fraction", ylim=(0, 1.05))
    _integer_x(ax)
    _legend(ax)


def _integer_x(ax: Axes) -> None:
    """Versions and steps are whole numbers: no 2.5 on their axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend(ax: Axes) -> None:
    """A legend when something is labelled (an empty plot of a missing file has nothing to name)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _bin_means(points: Sequence[tuple[float, float]], bins: int) -> list[tuple[float, float]]:
    if not points:
        return []
    ordered = sorted(points)
    size = max(1, len(ordered) // bins)
    chunks = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    return [(statistics.fmean(t for t, _ in c), statistics.fmean(v for _, v in c)) for c in chunks]


# --- the report -------------------------------------------------------------------------------------------
def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the plots and ``report.md`` for ``run_dir`` into ``out`` (default: ``run_dir``); returns them."""
    data = RunData.load(run_dir)
    out = Path(out) if out is not None else data.run_dir
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()

    def save(name: str, fig: Figure) -> Path:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        return out / name

    written: list[Path] = []
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    draw_reward(ax, data.reward_points(), data.rewards_by_source())
    _legend(ax)
    written.append(save("reward.png", fig))
    fig, ax = plt.subplots(figsize=(6, 4.2))
    draw_staleness(ax, data.staleness())
    written.append(save("staleness.png", fig))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    draw_bytes(ax, data.deltas(), data.full_bytes(), data.keyframes())
    written.append(save("sync_bytes.png", fig))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    draw_swap_pauses(ax, data.pauses_by_worker())
    written.append(save("swap_pauses.png", fig))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    draw_mismatch(left, data.steps)
    draw_correction(right, data.steps)
    written.append(save("mismatch.png", fig))
    report = out / "report.md"
    report.write_text(summary_markdown(data))
    written.append(report)
    return written


def headline(data: RunData) -> list[tuple[str, str]]:
    """The figures a person looks at first, as (what, value) rows."""
    rows: list[tuple[str, str]] = []
    steps = data.steps
    times = [e["t"] for e in steps if "t" in e]
    if times:
        rows.append(("trainer steps logged", f"{len(steps)} over {max(times) - data.t0:.0f} s"))
    versions = [s["version"] for s in steps if _num(s.get("version"))]
    if versions:
        rows.append(("policy versions", f"{min(versions)} → {max(versions)}"))
    trained = sum(int(s.get("rollouts") or 0) for s in steps)
    if trained:
        rows.append(("rollouts trained", f"{trained:,}"))
    rewards = [r for _, r in data.reward_points()]
    if rewards:
        k = min(5, len(rewards))
        rows.append((f"mean reward, first / last {k} steps",
                     f"{statistics.fmean(rewards[:k]):.3f} → {statistics.fmean(rewards[-k:]):.3f}"))
    histogram = data.staleness()
    if histogram:
        total = sum(histogram.values())
        rows.append(("staleness of trained rollouts",
                     f"{100 * histogram.get(0, 0) / total:.0f} % on-policy, max {max(histogram)} versions behind"))
    deltas = [b for _, b in data.deltas()]
    full = data.full_bytes()
    if deltas and full:
        mean = statistics.fmean(deltas)
        rows.append(("weight delta vs full size",
                     f"mean {mean:,.0f} B of {full:,} B ({100 * mean / full:.2f} %) over {len(deltas)} versions"))
    if data.keyframes():
        rows.append(("keyframes published", str(len(data.keyframes()))))
    pauses = [ms for pts in data.pauses_by_worker().values() for _, ms in pts]
    if pauses:
        rows.append(("swap pause", f"p50 {percentile(pauses, 50):.2f} ms, p99 {percentile(pauses, 99):.2f} ms, "
                                   f"max {max(pauses):.2f} ms over {len(pauses)} swaps, "
                                   f"{len(data.pauses_by_worker())} workers"))
    kl = [s["kl_k3"] for s in steps if _num(s.get("kl_k3"))]
    if kl:
        rows.append(("KL(behaviour‖trainer) k3", f"median {statistics.median(kl):.2e}, max {max(kl):.2e}"))
    return rows


def summary_markdown(data: RunData) -> str:
    lines = [f"# rlbus run report: `{data.run_dir.name or data.run_dir}`", "", "| | |", "|---|---|"]
    lines += [f"| {what} | {value} |" for what, value in headline(data)]
    summary = data.summary or {}
    outcomes = summary.get("outcomes")
    if isinstance(outcomes, dict) and outcomes:
        lines += ["", "## Outcomes of produced rollouts", "", "| outcome | rollouts |", "|---|---:|"]
        lines += [f"| {k} | {v:,} |" for k, v in sorted(outcomes.items()) if _num(v)]
    figures = {k: v for k, v in summary.items() if k != "outcomes" and (_num(v) or isinstance(v, str))}
    if figures:
        lines += ["", "## summary.json", "", "| figure | value |", "|---|---:|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in figures.items()]
    elif data.summary is None:
        lines += ["", "_No summary.json: the run's driver did not finish (or does not write one)._"]
    missing = [f"{name}.jsonl" for name, events in ((WEIGHTS, data.weights), (REWARDS, data.rewards)) if not events]
    if not data.syncs:
        missing.append("syncs-*.jsonl")
    if missing:
        lines += ["", f"_Not in this run log: {', '.join(missing)} (their plots are empty)._"]
    lines += ["", "## Plots", ""]
    lines += [f"![{name.removesuffix('.png')}]({name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
