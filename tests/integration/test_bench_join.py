"""``rlbus bench join`` on a small size: the JSON's shape, and both paths releasing the same groups."""

from __future__ import annotations

import json
from pathlib import Path

from rlbus_tools.bench import join as bench_join


def test_bench_join_writes_both_paths_and_they_release_the_same_groups(tmp_path: Path) -> None:
    out = tmp_path / "join.json"
    result = bench_join.run(quick=True, json_path=out, sizes=(4, 8), rollouts=16)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result) == {"by_g", "config", "summary", "meta"}
    assert set(result["by_g"]) == {"4", "8"}
    for size, figures in result["by_g"].items():
        assert figures["groups"] == 16 // int(size) and figures["rollouts"] == 16
        for path in ("old", "new"):
            assert figures[path]["groups_released"] == figures["groups"]
            assert figures[path]["rollouts_per_s"] > 0 and figures[path]["per_rollout_us"] > 0
        assert figures["same_groups"] is True
    summary = result["summary"]
    assert summary["same_groups"] is True and {"speedup_g4", "speedup_g8"} <= set(summary)
    assert result["meta"]["quick"] is True and "commit" in result["meta"] and result["config"]["store"] == "redis"
