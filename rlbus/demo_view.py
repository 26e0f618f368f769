"""What the demo shows a person: the live table while it runs, and the summary and plot at the end."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

if TYPE_CHECKING:
    from rlbus.demo import Demo, DemoResult


def status_line(demo: Demo) -> str:
    """One line of the live view, for logs (a non-terminal stdout gets these instead of the table)."""
    trainer = demo.trainer
    parts = [f"[{demo.phase}]"]
    if demo.accuracy_base is not None:
        parts.append(f"accuracy before warm start {demo.accuracy_base:.0%}")
    if demo.accuracy_start is not None:
        parts.append(f"after {demo.accuracy_start:.0%}")
    if trainer is not None:
        parts.append(f"step {trainer.step} v{trainer.version}")
    if demo.step_metrics:
        recent = [m["reward_mean"] for m in demo.step_metrics[-5:]]
        parts.append(f"reward(last 5) {statistics.fmean(recent):.3f}")
    if demo.publisher is not None and len(demo.publisher.history) > 1:
        last = demo.publisher.history[-1]
        parts.append(f"delta {100 * last.delta_bytes / last.full_bytes:.2f} %")
    if demo.accuracy_end is not None:
        parts.append(f"accuracy after RL {demo.accuracy_end:.0%}")
    return "  ".join(parts)


def live_table(demo: Demo) -> Table:
    elapsed = demo.reward_points[-1][0] if demo.reward_points else 0.0
    table = Table(title=f"rlbus demo — {demo.phase}", show_header=False, min_width=72)
    table.add_column("what", style="bold")
    table.add_column("value")
    rewards = [r for _, r in demo.reward_points]
    recent = statistics.fmean(rewards[-5:]) if rewards else float("nan")
    first = statistics.fmean(rewards[:5]) if rewards else float("nan")
    table.add_row("warm-start accuracy", "…" if demo.accuracy_start is None else f"{demo.accuracy_start:.0%}")
    trainer = demo.trainer
    table.add_row("trainer", f"step {trainer.step}, version {trainer.version}" if trainer else "—")
    table.add_row("reward (first 5 / last 5 steps)", f"{first:.3f} / {recent:.3f}" if rewards else "—")
    versions = ", ".join(f"{w.region}: v{s.version}" for w, s in zip(demo.rollout_workers, demo.syncs, strict=False))
    table.add_row("worker versions", versions or "—")
    if demo.step_metrics:
        m = demo.step_metrics[-1]
        hist = " ".join(f"{k}:{v}" for k, v in sorted(m["staleness"].items()))
        table.add_row("staleness (versions: rollouts)", hist)
        table.add_row("KL(behaviour‖trainer) k3 / router flips", f"{m['kl_k3']:.2e} / {m['router_flip_rate'] or 0:.3f}")
    if demo.publisher is not None and len(demo.publisher.history) > 1:
        last = demo.publisher.history[-1]
        table.add_row("last delta / full", f"{last.delta_bytes:,} B / {last.full_bytes:,} B "
                      f"({100 * last.delta_bytes / last.full_bytes:.1f} %)")
    pauses = [s.swap_pause_s * 1000 for sync in demo.syncs for s in sync.history[-3:]]
    if pauses:
        table.add_row("recent swap pauses", f"max {max(pauses):.2f} ms")
    table.add_row("rollouts", f"{sum(w.rollouts for w in demo.rollout_workers)} produced")
    table.add_row("elapsed", f"{elapsed:.0f} s")
    return table


def summary_table(result: DemoResult) -> Table:
    table = Table(title="rlbus demo — summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        *([("accuracy before the warm start", f"{result.accuracy_base:.0%}")] if result.accuracy_base is not None
          else []),
        ("accuracy after warm start → after RL", f"{result.accuracy_start:.0%} → {result.accuracy_end:.0%}"),
        ("RL steps / versions published", f"{result.steps} / {result.versions_published}"),
        ("rollouts trained / dropped", f"{result.rollouts_trained} / {result.rollouts_dropped}"),
        ("max staleness seen", f"{result.max_staleness} versions"),
        ("mean delta vs full weights", f"{result.delta_bytes_mean:,.0f} B vs {result.full_bytes:,} B "
         f"({100 * result.delta_bytes_mean / max(1, result.full_bytes):.1f} %)"),
        ("swap pause p99", f"{result.swap_pause_ms_p99:.2f} ms"),
        ("wall time", f"{result.wall_s:.0f} s"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def plot(result: DemoResult, path: Path) -> Path:
    """Reward vs time, staleness histogram, and delta size per version vs the full size (drawn by the
    same functions as ``rlbus report``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlbus.observe.report import draw_bytes, draw_reward, draw_staleness

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    draw_reward(axes[0], result.rewards)
    axes[0].axhline(result.accuracy_start, ls="--", c="grey", lw=0.8, label="greedy accuracy after warm start")
    axes[0].axhline(result.accuracy_end, ls=":", c="green", lw=1, label="greedy accuracy at the end")
    axes[0].legend(fontsize=8)
    draw_staleness(axes[1], result.staleness)
    draw_bytes(axes[2], result.deltas, result.full_bytes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path



def watch(demo: Demo, console: Console, *, dashboard: int | None = None) -> DemoResult:
    """Run ``demo`` while showing it: the live table on a terminal, status lines in a log (every 10 s and at
    each phase change), and the web dashboard on ``dashboard`` when given."""
    with Live(console=console, refresh_per_second=4) as live:
        demo.on_update = (lambda d: live.update(live_table(d))) if console.is_terminal else status_logger(console)
        if dashboard is None:
            return asyncio.run(demo.run())
        from rlbus.observe.dashboard import run_demo

        return asyncio.run(run_demo(demo, port=dashboard, on_ready=lambda url: console.print(
            f"dashboard: [bold]{url}[/bold] (while the demo runs)")))


def status_logger(console: Console, every_s: float = 10.0, quiet_s: float = 60.0) -> Callable[[Any], None]:
    """The demo's log when stdout is not a terminal: a phase change at once; a changed status line at most
    every ``every_s``; an unchanged one only every ``quiet_s``, saying for how long nothing changed (a
    stall reads as one line a minute, not the same line every 10 s)."""
    #: t / phase / printed: the last line printed; seen / changed: the last line built and when it changed.
    last: dict[str, Any] = {"t": 0.0, "phase": "", "printed": "", "seen": "", "changed": time.monotonic()}

    def log(demo: Any) -> None:
        now, line = time.monotonic(), status_line(demo)
        if line != last["seen"]:
            last.update(seen=line, changed=now)
        if demo.phase != last["phase"] or (line != last["printed"] and now - last["t"] >= every_s):
            console.print(line, markup=False, highlight=False)
        elif line == last["printed"] and now - last["t"] >= quiet_s:
            console.print(f"{line}  (no change for {now - last['changed']:.0f} s)", markup=False, highlight=False)
        else:
            return
        last.update(t=now, phase=demo.phase, printed=line)

    return log
