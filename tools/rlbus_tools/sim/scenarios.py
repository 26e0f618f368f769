"""The questions ``rlbus sim`` answers about one fleet: the run as configured, the same fleet trained
synchronously (the speedup's baseline), and the what-ifs an operator asks before a long run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from msgspec.structs import replace

from rlbus_tools.sim.fleet import FaultSection, Fleet
from rlbus_tools.sim.model import Simulation
from rlbus_tools.sim.report import closed_form_staleness


def _region_down(fleet: Fleet) -> Fleet:
    """The largest region cut off for 30 minutes, a third of the way into the measured window."""
    region = max(fleet.region, key=lambda r: r.workers * r.tokens_per_s).name
    at = fleet.sim.warmup_s + (fleet.sim.duration_s - fleet.sim.warmup_s) / 3
    return replace(fleet, fault=[*fleet.fault, FaultSection(kind="region_down", region=region, at_s=at, for_s=1800.0)])


def _half_wan(fleet: Fleet) -> Fleet:
    return replace(
        fleet,
        region=[replace(r, wan_gbps=r.wan_gbps / 2) for r in fleet.region],
        trainer=replace(fleet.trainer, egress_gbps=fleet.trainer.egress_gbps / 2),
    )


def _g128(fleet: Fleet) -> Fleet:
    """G = 128 with the same rollouts per step (fewer, larger groups): longer group tails."""
    t = fleet.trainer
    groups = max(1, t.groups_per_step * t.group_size // 128)
    return replace(fleet, trainer=replace(t, group_size=128, groups_per_step=groups))


def _traffic_3x(fleet: Fleet) -> Fleet:
    """Production traffic peaking at 3× its base share during the run."""
    traffic = fleet.traffic
    share = traffic.share or 0.2
    return replace(fleet, traffic=replace(traffic, share=share, profile=[(0.0, 1.0), (3.0, 3.0), (6.0, 1.0)]))


def _no_relay(fleet: Fleet) -> Fleet:
    return replace(fleet, region=[replace(r, relay=False) for r in fleet.region])


WHAT_IFS: dict[str, tuple[str, Callable[[Fleet], Fleet]]] = {
    "region-down": ("the largest region cut off for 30 min", _region_down),
    "half-wan": ("every WAN link and the origin's egress at half bandwidth", _half_wan),
    "g128": ("G = 128, same rollouts per step", _g128),
    "traffic-3x": ("production traffic peaking at 3× its share", _traffic_3x),
    "no-relay": ("no regional relays: every worker pulls across the WAN", _no_relay),
}


def run_scenarios(
    fleet: Fleet, what_ifs: Sequence[str] = (), *, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """``async`` (the fleet as given), ``sync`` (when ``[sim] sync_baseline``) and each what-if; the JSON
    ``rlbus sim`` writes, with ``summary`` = the async run's headline figures and the speedup."""
    unknown = [name for name in what_ifs if name not in WHAT_IFS]
    if unknown:
        raise ValueError(f"unknown what-if {unknown[0]!r}; choose from {', '.join(WHAT_IFS)}")
    results: dict[str, dict[str, Any]] = {}

    def simulate(name: str, target: Fleet, mode: str = "async") -> None:
        if progress is not None:
            progress(name)
        results[name] = Simulation(target, mode).run()  # type: ignore[arg-type]

    simulate("async", fleet)
    if fleet.sim.sync_baseline:
        simulate("sync", fleet, "sync")
    for name in what_ifs:
        simulate(name, WHAT_IFS[name][1](fleet))
    base = results["async"]["summary"]
    speedup = None
    if "sync" in results and results["sync"]["summary"]["trained_tokens_per_s"]:
        speedup = round(base["trained_tokens_per_s"] / results["sync"]["summary"]["trained_tokens_per_s"], 3)
    return {
        "summary": {
            "async_vs_sync_speedup": speedup,
            "delta_transfer_s_by_region": base["delta_transfer_s_by_region"],
            "staleness_mean_versions": base["staleness_mean_versions"],
            # Little's law on the same run: holds when the trainer is the bottleneck (utilisation ≥ 0.8)
            "staleness_closed_form": None if not base["version_interval_s"] else round(closed_form_staleness(
                base["in_system_groups_mean"], fleet.trainer.groups_per_step * fleet.trainer.publish_every,
                base["sync_lag_mean_s"] or 0.0, base["version_interval_s"]), 4),
            "trainer_busy": base["utilisation"]["trainer"],
            "trained_tokens_per_s": base["trained_tokens_per_s"],
            "publish_to_all_swapped_s_p50": base["publish_to_all_swapped_s_p50"],
            "wan_bytes_per_version_by_region": base["wan_bytes_per_version_by_region"],
            "full_snapshot_transfer_s_by_region": base["full_snapshot_transfer_s_by_region"],
        },
        "what_ifs": {name: WHAT_IFS[name][0] for name in what_ifs},
        "fleet": fleet.to_dict(),
        "scenarios": results,
    }
