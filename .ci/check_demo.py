"""CI's check of `make demo`'s summary (runs/demo/summary.json): the demo did what the README says on a
fresh clone with an empty numba cache — every RL step done within its time budget, greedy accuracy up by at
least 30 points, and at most 5 % of the trained rollouts' count dropped as stale."""

from __future__ import annotations

import json
import sys
from pathlib import Path

summary = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo/summary.json").read_text())
stale = summary["outcomes"].get("dropped_stale", 0)
checks = {
    f"all {summary['steps_target']} RL steps done (did {summary['steps']})": summary["completed"],
    f"accuracy {summary['accuracy_start']:.0%} → {summary['accuracy_end']:.0%}, at least +30 points":
        summary["accuracy_end"] >= summary["accuracy_start"] + 0.30,
    f"{stale} rollouts dropped as stale, at most 5 % of the {summary['rollouts_trained']} trained":
        stale <= 0.05 * summary["rollouts_trained"],
}
for what, ok in checks.items():
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
if summary.get("stalled"):
    print(f"stalled: {summary['stalled']}")
sys.exit(0 if all(checks.values()) else 1)
