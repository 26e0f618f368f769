"""The embedded demo's whole loop, cut down to seconds: every role runs, versions flow as deltas, and every
trained rollout is accounted for exactly once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlbus.demo import Demo, DemoConfig, DemoResult
from rlbus.demo_view import plot, summary_table


async def test_demo_runs_every_role_end_to_end(tmp_path: Path) -> None:
    config = dataclasses.replace(
        DemoConfig.quick(), workers=2, warm_steps=10, rl_steps=3, groups_per_step=2, group_size=4,
        time_budget_s=120, eval_size=10,
    )
    demo = Demo(config, tmp_path)
    result: DemoResult = await demo.run()
    assert result.steps == 3 and result.versions_published == 4  # v1 = the warm start, then one per step
    assert all(s.version is not None and s.version >= 2 for s in demo.syncs)
    assert all(s.digest == demo.syncs[0].digest for s in demo.syncs if s.version == demo.syncs[0].version)
    assert result.rollouts_trained >= 3 * 2 * 4
    assert result.outcomes["duplicate"] == 0 and result.outcomes["dead_lettered"] == 0
    assert 0 < result.delta_bytes_mean < result.full_bytes
    assert result.swap_pause_ms_p99 < 50
    assert 0.0 <= result.accuracy_start <= 1.0 and 0.0 <= result.accuracy_end <= 1.0
    assert plot(result, tmp_path / "demo.png").stat().st_size > 10_000
    assert summary_table(result).row_count >= 5
