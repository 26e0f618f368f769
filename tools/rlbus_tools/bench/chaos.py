"""``rlbus bench chaos``: every chaos scenario on a private Kafka cluster and Redis, and the ledger's verdict.

Starts a three-broker KRaft cluster and a Redis server with an fsync-always append-only file in a
temporary directory on free ports (never the Kafka on 9092), runs each scenario of :mod:`rlbus_tools.chaos`
with a fixed seed, and prints one row per scenario: faults injected, rollouts produced, trained, dropped
by reason, dead-lettered, duplicates trained, lost, corrupt weights applied, recovery time. The JSON has
``scenarios[]`` with those fields (plus each scenario's checks and notes) and ``summary`` with the totals
that must all be 0: ``lost``, ``duplicates_trained``, ``corrupt_applied``.

There is no same-run baseline to divide by: the figures are counts that must be zero, and recovery times
that depend on the fault (a broker's session timeout, a Redis restart, the blob client's backoff).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from rlbus_tools.bench.common import JsonPath, Quick, meta, require, write_json
from rlbus_tools.chaos import ScenarioReport, scenarios
from rlbus_tools.chaos.rig import ChaosRig


def run(
    quick: bool, json_path: Path | None, names: list[str] | None = None, seed: int = 0
) -> dict[str, Any]:
    # Broker, Redis and blob-store failures are the point here: their warnings would bury the table.
    for noisy in ("aiokafka", "rlbus"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    reports, rig_s = asyncio.run(_run(quick, names, seed))
    result = summarize(reports)
    result["meta"] = {**meta(), "quick": quick, "seed": seed, "rig_start_s": round(rig_s, 1)}
    table = Table(title="rlbus bench chaos — faults injected, then the exactly-once ledger audited")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("scenario", "dropped") else "right", no_wrap=True)
    for r in result["scenarios"]:
        table.add_row(*[str(v) for v in row(r)])
    Console(width=max(160, Console().width)).print(table)
    for r in result["scenarios"]:
        if not r["passed"]:
            failed = [name for name, ok in r["checks"].items() if not ok]
            Console(stderr=True).print(f"[red]{r['scenario']}[/red]: failed {failed}; {r['notes'][:2]}")
    write_json(json_path, result)
    return result


COLUMNS = ["scenario", "faults", "produced", "trained", "dropped", "dead-lettered", "dup. trained", "lost",
           "corrupt applied", "recovery s", "passed"]


def row(r: dict[str, Any]) -> list[Any]:
    """One table row (also the line of bench/RESULTS.md)."""
    dropped = ", ".join(f"{k.removeprefix('dropped_')} {v}" for k, v in r["dropped"].items()) or "0"
    recovery = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
    return [r["scenario"], len(r["faults"]), r["produced"], r["trained"], dropped, r["dead_lettered"],
            r["duplicates_trained"], r["lost"], r["corrupt_applied"], recovery, "yes" if r["passed"] else "NO"]


def summarize(reports: list[ScenarioReport]) -> dict[str, Any]:
    rows = [r.as_dict() for r in reports]
    return {
        "scenarios": rows,
        "summary": {
            "scenarios": len(rows),
            "passed": sum(r["passed"] for r in rows),
            "lost": sum(r["lost"] for r in rows),
            "duplicates_trained": sum(r["duplicates_trained"] for r in rows),
            "corrupt_applied": sum(r["corrupt_applied"] for r in rows),
        },
    }


async def _run(quick: bool, names: list[str] | None, seed: int) -> tuple[list[ScenarioReport], float]:
    chosen = scenarios()
    unknown = set(names or ()) - set(chosen)
    if unknown:
        raise ValueError(f"unknown chaos scenario(s) {sorted(unknown)}; choose from {list(chosen)}")
    with tempfile.TemporaryDirectory(prefix="rlbus-chaos-") as tmp:
        began = time.monotonic()
        rig = await asyncio.to_thread(ChaosRig.start, Path(tmp))
        rig_s = time.monotonic() - began
        try:
            reports = []
            for name, scenario in chosen.items():
                if names and name not in names:
                    continue
                began = time.monotonic()
                try:
                    reports.append(await scenario(rig, seed=seed, quick=quick))
                except Exception as exc:  # one broken scenario must not hide the others' figures
                    failed = ScenarioReport(scenario=name, wall_s=round(time.monotonic() - began, 2))
                    failed.check("the scenario ran to its end", False)
                    failed.notes.append(f"{type(exc).__name__}: {str(exc)[:600]}")
                    reports.append(failed.finish())
        finally:
            await asyncio.to_thread(rig.stop)
    return reports, rig_s


def main(
    json_path: JsonPath = None,
    quick: Quick = False,
    seed: Annotated[int, typer.Option(help="The seed; repeat runs to see the spread.")] = 0,
) -> None:
    """Fault scenarios on real Kafka, Redis and workers; each checks the exactly-once ledger."""
    result = run(quick=quick, json_path=json_path, seed=seed)
    summary = result["summary"]
    require(summary["passed"] == summary["scenarios"], "a chaos scenario failed its checks (see the table)")
