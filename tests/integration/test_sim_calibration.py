"""The quick calibration CI runs: three real ``rlbus up`` runs on Kafka and Redis, each measured from its run
log and predicted by the simulator fed only the measured parameters (``rlbus bench sim-calibration --quick``).

The bench's target is 25 % on every figure; this test holds the largest error under 50 %, so a noisy CI
machine does not fail it while a broken measurement or model (errors of 100 %+, as the first versions of
the calibration had) still does. The recorded figures are in bench/RESULTS.md."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from rlbus_tools.bench import sim_calibration
from rlbus_tools.sim.calibrate import FIGURES
from tests.conftest import KAFKA_BOOTSTRAP

pytestmark = pytest.mark.timeout(900)


@pytest.mark.slow
def test_the_simulator_predicts_three_real_runs(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, port = KAFKA_BOOTSTRAP.split(",")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), 2).close()
    except OSError as exc:
        pytest.fail(f"no Kafka at {KAFKA_BOOTSTRAP}: {exc}")
    monkeypatch.setenv("RLBUS_REDIS_URL", redis_url)
    monkeypatch.setenv("RLBUS_KAFKA_BOOTSTRAP", KAFKA_BOOTSTRAP)
    out = tmp_path / "simcal.json"
    result = sim_calibration.run(quick=True, json_path=out)
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert result["summary"]["configurations"] == 3
    cases = result["cases"]
    assert len({(c["workers"], c["groups_per_step"], c["max_staleness"]) for c in cases}) == 3
    for case in cases:
        assert set(case["measured"]) == set(FIGURES) == set(case["predicted"])
        assert case["measured"]["trained_rollouts_per_min"] > 0
        assert case["calibration"]["parameters"]["rollouts_measured"] > 0
        assert case["measured"]["staleness_mean_versions"] <= case["max_staleness"]
    assert result["summary"]["calibration_max_error"] < 0.5, json.dumps(
        [{k: c[k] for k in ("case", "measured", "predicted", "errors")} for c in cases], indent=1
    )
