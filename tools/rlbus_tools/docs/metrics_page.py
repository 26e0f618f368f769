"""docs/reference/metrics.md: every Prometheus metric rlbus exports, from `rlbus.metrics.metrics_table`."""

from __future__ import annotations

from rlbus import metrics
from rlbus_tools.docs.markdown import GENERATED


def render() -> str:
    return "\n".join([
        GENERATED,
        "",
        "# Metrics",
        "",
        "Every metric an rlbus process serves at `/metrics`, besides the process and Python collectors, generated "
        "from the definitions in `rlbus/metrics.py`. Where they are served, how to read them and handy queries: "
        "[observability](../observability.md).",
        "",
        metrics.metrics_table(),
        "",
    ])
