"""Every Prometheus metric an rlbus process exports, defined in one place, and the `/metrics` endpoint.

The metrics live in one registry of their own (:data:`REGISTRY`, plus the process/GC/platform collectors)
rather than prometheus-client's global default, so nothing a library registers leaks into rlbus's
exposition and tests can read exact values. Call sites stay one line: the workers count and time through
the small ``record_*`` helpers and metric objects below, never through prometheus-client directly.
The metrics reference page (docs/reference/metrics.md) is generated from these definitions (:func:`metrics_table`).

Two pieces run as part of a process: :func:`serve_metrics` (an aiohttp app serving the text exposition,
as an async context manager) and :class:`LoopLagMonitor` (measures how late the event loop runs a timer —
blocking work on the loop shows up here, docs/architecture.md §9.2). The consumer-lag gauge is refreshed by
:class:`rlbus.observe.lag.LagProbe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from rlbus.errors import ServiceError
from rlbus.exposure import BearerAuth, check_bind, load_token

if TYPE_CHECKING:
    from rlbus.bus.types import Record

log = logging.getLogger("rlbus.metrics")

#: The text exposition format every Prometheus since 2.0 reads (the names here need no UTF-8 escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REGISTRY = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    # The default collectors are also registered globally; the same objects serve this registry too.
    with contextlib.suppress(ValueError):
        REGISTRY.register(_collector)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PAUSE_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5)
_LOOP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_REWARD_BUCKETS = (-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)

# --- bus ------------------------------------------------------------------------------------------
MESSAGES_IN = Counter(
    "rlbus_messages_in", "Records a worker took off a topic for processing.", ["topic"], registry=REGISTRY
)
MESSAGES_OUT = Counter(
    "rlbus_messages_out", "Records written to a topic and acknowledged (typed sends).", ["topic"], registry=REGISTRY
)
CONSUMER_LAG = Gauge(
    "rlbus_consumer_lag",
    "Records not yet committed by the group on a partition this process owns (end offset − committed).",
    ["topic", "partition", "group"],
    registry=REGISTRY,
)
PROCESSING_SECONDS = Histogram(
    "rlbus_processing_seconds",
    "Time from taking a message to its effect being acknowledged (rollout: a prompt's whole group).",
    ["role"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "rlbus_dead_letters",
    "Records sent to the dead-letter topic, by source topic and error class.",
    ["topic", "reason"],
    registry=REGISTRY,
)

# --- rollouts, rewards, admission -----------------------------------------------------------------
POLICY_VERSION = Gauge(
    "rlbus_policy_version", "Policy version a rollout worker generates with.", ["worker"], registry=REGISTRY
)
REWARD = Histogram(
    "rlbus_reward",
    "Reward values published, by source (verifier, sandbox, judge …); its _count counts rewards.",
    ["source"],
    buckets=_REWARD_BUCKETS,
    registry=REGISTRY,
)
HACKS = Counter(
    "rlbus_reward_hacks",
    "Rollouts in which an environment found reward hacking, by kind (hack monitor kinds; tampered: the test run was).",
    ["kind"],
    registry=REGISTRY,
)
ADMISSION_WAITS = Counter(
    "rlbus_prompt_admission_waits",
    "Times the prompt producer held back because admission control (the staleness bound) said no.",
    registry=REGISTRY,
)

# --- weights --------------------------------------------------------------------------------------
BLOB_FAILOVERS = Counter(
    "rlbus_blob_failovers", "Blob reads a worker made from the origin because its region's relay failed.",
    registry=REGISTRY,
)
SYNC_BYTES = Counter(
    "rlbus_weight_sync_bytes", "Chunk bytes a worker downloaded to apply weight versions.", ["worker"],
    registry=REGISTRY,
)
SYNC_STAGE_SECONDS = Histogram(
    "rlbus_weight_sync_stage_seconds",
    "Download + verify + decode time of one version, while generation continues.",
    ["worker"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
SWAP_PAUSE_SECONDS = Histogram(
    "rlbus_weight_swap_pause_seconds",
    "Time generation was paused to swap one version in.",
    ["worker"],
    buckets=_PAUSE_BUCKETS,
    registry=REGISTRY,
)
SYNC_LAG_SECONDS = Histogram(
    "rlbus_weight_sync_lag_seconds",
    "Manifest creation by the trainer → version swapped in and verified on the worker (two clocks).",
    ["worker"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
SYNC_REFUSED = Counter(
    "rlbus_weight_sync_refused",
    "Versions a worker refused (gap, corrupt chunk, digest mismatch) before rebuilding from a keyframe.",
    ["worker"],
    registry=REGISTRY,
)
PUBLISH_BYTES = Counter(
    "rlbus_weight_publish_bytes", "Encoded bytes the trainer uploaded, by kind (delta, keyframe).", ["kind"],
    registry=REGISTRY,
)
FULL_BYTES = Gauge(
    "rlbus_weight_full_bytes",
    "Size of one full snapshot in the inference dtype: the baseline a delta is compared with.",
    registry=REGISTRY,
)
PUBLISH_SECONDS = Histogram(
    "rlbus_weight_publish_seconds",
    "Encode + upload + announce time of one published version.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)

# --- trainer --------------------------------------------------------------------------------------
TRAINER_VERSION = Gauge("rlbus_trainer_version", "Newest policy version the trainer published.", registry=REGISTRY)
TRAINER_STEP = Gauge("rlbus_trainer_step", "GRPO steps the trainer has taken.", registry=REGISTRY)
TRAINER_STEP_SECONDS = Histogram(
    "rlbus_trainer_step_seconds",
    "Wall time of one GRPO step (forward, backward, optimizer), publishing and checkpointing excluded.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TRAINER_ROLLOUTS = Counter("rlbus_trainer_rollouts", "Rollouts trained on.", registry=REGISTRY)
TRAINER_TOKENS = Counter("rlbus_trainer_tokens", "Loss tokens trained on.", registry=REGISTRY)
STALENESS = Histogram(
    "rlbus_rollout_staleness_versions",
    "Versions between the trainer and a rollout's oldest token when batched (before stale ones drop).",
    buckets=_STALENESS_BUCKETS,
    registry=REGISTRY,
)
#: Per-step figures of `rlbus.training.step.StepMetrics`, each the latest step's value.
TRAINER_GAUGES: dict[str, Gauge] = {
    key: Gauge(f"rlbus_trainer_{key}", text, registry=REGISTRY)
    for key, text in {
        "kl_k3": "KL(behaviour ‖ trainer) by the k3 estimator over the latest step's trained tokens.",
        "max_abs_dlogprob": "Largest |log π_trainer − log μ_behaviour| of the latest step.",
        "router_flip_rate": "Share of (MoE layer, token) pairs whose top-k experts differ trainer vs engine.",
        "is_ess": "Normalised ESS (Σw)²/(N·Σw²) of the latest step's importance weights; 1 = all equal.",
        "clip_fraction": "Share of tokens whose PPO ratio was clipped in the latest step.",
        "mask_fraction": "Share of tokens masked out by MIS in the latest step.",
        "reward_mean": "Mean reward of the latest step's batch.",
        "hacked": "Share of the latest step's rollouts whose rewards report reward hacking (Reward.hack_kinds).",
        "loss": "Objective of the latest step.",
        "grad_norm": "Gradient norm before clipping of the latest step.",
        "online_samples": "Served rollouts trained in the latest online step (docs/online.md).",
        "online_baseline": "The global online baseline after the latest online step.",
        "online_releases_total": "Online releases (steps on served traffic) so far.",
        "online_dropped_age_total": "Served rollouts dropped for max_age_s at training time so far.",
    }.items()
}

# --- serving (rlbus.serve) -----------------------------------------------------------------------
SERVE_REQUESTS = Counter(
    "rlbus_serve_requests", "Gateway requests answered, by route and HTTP status.", ["route", "status"],
    registry=REGISTRY,
)
SERVE_LATENCY_SECONDS = Histogram(
    "rlbus_serve_latency_seconds", "Chat completion latency, request arrival to last token.",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
SERVE_TOKENS = Counter(
    "rlbus_serve_tokens", "Tokens the gateway served, by kind (prompt, completion).", ["kind"], registry=REGISTRY
)
SERVE_REJECTED = Counter(
    "rlbus_serve_rejected", "RL-session requests answered 429 by admission control, by reason.", ["reason"],
    registry=REGISTRY,
)
SERVE_HISTORY_EDITS = Counter(
    "rlbus_serve_history_edits",
    "Session requests whose history did not match the turns the gateway sampled (re-tokenised, untrained).",
    registry=REGISTRY,
)
SERVE_SESSIONS_OPEN = Gauge("rlbus_serve_sessions_open", "Agent sessions open in the gateway.", registry=REGISTRY)
SERVED_RECORDED = Counter(
    "rlbus_served_recorded", "Served completions written to rl.served.v1 (acknowledged).", registry=REGISTRY
)
SERVED_BUFFERED = Gauge(
    "rlbus_served_buffered", "Served records waiting in the gateway's buffer for the bus.", registry=REGISTRY
)
SERVED_DROPPED = Counter(
    "rlbus_served_dropped", "Served records dropped because the buffer was full while the bus was down.",
    registry=REGISTRY,
)

# --- process --------------------------------------------------------------------------------------
LOOP_LAG_SECONDS = Histogram(
    "rlbus_event_loop_lag_seconds",
    "How late the event loop ran a timer: time the loop was blocked by work that belongs in a thread.",
    buckets=_LOOP_BUCKETS,
    registry=REGISTRY,
)

# --- LM judges ------------------------------------------------------------------------------------
JUDGE_SECONDS = Histogram(
    "rlbus_judge_seconds",
    "Time of one LM judgement (every dimension and retry of one rollout), by reward source.",
    ["source"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
JUDGE_RETRIES = Counter(
    "rlbus_judge_retries",
    "Judge calls repeated because the reply had no readable or an out-of-range score, by reward source.",
    ["source"],
    registry=REGISTRY,
)
JUDGE_INVALID = Counter(
    "rlbus_judge_invalid",
    "Judgements published invalid (a dimension still unreadable after the retries), by reward source.",
    ["source"],
    registry=REGISTRY,
)


def rlbus_metrics() -> list[MetricWrapperBase]:
    """Every metric defined above, in definition order (the reference table's rows)."""
    return [m for m in REGISTRY._collector_to_names if isinstance(m, MetricWrapperBase)]


def metrics_table() -> str:
    """The metrics reference table (docs/reference/metrics.md): exposed name, kind, labels, meaning."""
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for metric in rlbus_metrics():
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "—"
        meaning = metric._documentation.replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {labels} | {meaning} |")
    return "\n".join(rows)


def exposition() -> bytes:
    """The current values in Prometheus text format."""
    return generate_latest(REGISTRY)


# --- recording helpers ----------------------------------------------------------------------------
# Per-message counters sit on the hot path of every send and batch: a cached child costs ~0.6 µs per
# increment where ``labels(...)`` costs ~4 µs (lock, tuple, dict) on the 2-core development machine.
@functools.lru_cache(maxsize=4096)
def _in(topic: str) -> Counter:
    return MESSAGES_IN.labels(topic)


@functools.lru_cache(maxsize=4096)
def _out(topic: str) -> Counter:
    return MESSAGES_OUT.labels(topic)


def count_in(records: Iterable[Record[Any]]) -> None:
    for record in records:
        _in(record.topic).inc()


def count_out(topic: str) -> None:
    _out(topic).inc()


def observe_processing(role: str, started: float) -> None:
    """Observe the time since ``started`` (a ``time.perf_counter()`` reading) for ``role``."""
    PROCESSING_SECONDS.labels(role).observe(time.perf_counter() - started)


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def record_step(metrics: Mapping[str, Any]) -> None:
    """One trainer step's metrics (`Trainer.train_on`'s dict, plus ``rollouts``)."""
    TRAINER_STEP.set(metrics.get("step", 0))
    TRAINER_VERSION.set(metrics.get("version", 0))
    if "step_s" in metrics:
        TRAINER_STEP_SECONDS.observe(metrics["step_s"])
    TRAINER_ROLLOUTS.inc(metrics.get("rollouts", 0))
    TRAINER_TOKENS.inc(metrics.get("tokens", 0))
    for behind, count in (metrics.get("staleness") or {}).items():
        for _ in range(int(count)):
            STALENESS.observe(int(behind))
    for key, gauge in TRAINER_GAUGES.items():
        value = _finite(metrics.get(key))
        if value is not None:
            gauge.set(value)


class SyncLike(Protocol):
    """What `record_sync` reads of `rlbus.weights.sync.SyncStats` (no torch import here)."""

    @property
    def version(self) -> int: ...
    @property
    def bytes_fetched(self) -> int: ...
    @property
    def stage_s(self) -> float: ...
    @property
    def swap_pause_s(self) -> float: ...
    @property
    def lag_s(self) -> float: ...


class PublishLike(Protocol):
    """What `record_publish` reads of `rlbus.weights.publish.PublishStats`."""

    @property
    def version(self) -> int: ...
    @property
    def full_bytes(self) -> int: ...
    @property
    def delta_bytes(self) -> int: ...
    @property
    def keyframe_bytes(self) -> int: ...
    @property
    def total_s(self) -> float: ...


def record_sync(worker: str, stats: SyncLike) -> None:
    """One version applied by a worker's `WeightSync` (its `SyncStats`)."""
    SYNC_BYTES.labels(worker).inc(stats.bytes_fetched)
    SYNC_STAGE_SECONDS.labels(worker).observe(stats.stage_s)
    SWAP_PAUSE_SECONDS.labels(worker).observe(stats.swap_pause_s)
    SYNC_LAG_SECONDS.labels(worker).observe(max(0.0, stats.lag_s))
    POLICY_VERSION.labels(worker).set(stats.version)


def record_publish(stats: PublishLike) -> None:
    """One version published by the trainer's `WeightPublisher` (its `PublishStats`)."""
    PUBLISH_BYTES.labels("delta").inc(stats.delta_bytes)
    PUBLISH_BYTES.labels("keyframe").inc(stats.keyframe_bytes)
    FULL_BYTES.set(stats.full_bytes)
    PUBLISH_SECONDS.observe(stats.total_s)
    TRAINER_VERSION.set(stats.version)


# --- event-loop lag -------------------------------------------------------------------------------
class LoopLagMonitor:
    """Sleeps ``interval_s`` in a loop and records how much later than asked it woke up.

    An event loop that is blocked (a hash, a model step, a sandbox wait run on the loop instead of a
    thread) cannot serve Kafka heartbeats, weight sync or the metrics endpoint; the delay of a plain
    timer measures exactly that. :meth:`stats` gives the heartbeat the worst delay since its last call.
    """

    def __init__(self, *, interval_s: float = 0.25, clock: Callable[[], float] = time.perf_counter) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self.last_s = 0.0
        self.max_s = 0.0
        self._window_max_s = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = self._clock()
            await asyncio.sleep(self.interval_s)
            self.observe(self._clock() - started - self.interval_s)

    def observe(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        LOOP_LAG_SECONDS.observe(lag_s)
        self.last_s = lag_s
        self.max_s = max(self.max_s, lag_s)
        self._window_max_s = max(self._window_max_s, lag_s)

    def stats(self) -> dict[str, float]:
        """``loop_lag_ms_max``: the worst delay since the previous call (then reset)."""
        worst, self._window_max_s = self._window_max_s, 0.0
        return {"loop_lag_ms_max": round(worst * 1000, 3)}


# --- the endpoint ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricsServer:
    host: str
    port: int
    #: Whether ``/metrics`` needs ``Authorization: Bearer <token>``.
    authenticated: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


@contextlib.asynccontextmanager
async def serve_metrics(
    port: int = 9400,
    host: str = "127.0.0.1",
    *,
    registry: CollectorRegistry = REGISTRY,
    token: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> AsyncIterator[MetricsServer]:
    """Serve ``GET /metrics`` (and an open ``GET /healthz``) on ``host:port`` while the block runs
    (``port=0``: any free port, see the yielded server).

    ``token`` (else ``$RLBUS_METRICS_TOKEN``, or the file ``$RLBUS_METRICS_TOKEN_FILE`` names, in
    ``environ``) makes ``/metrics`` need ``Authorization: Bearer <token>`` (Prometheus: ``authorization:
    credentials_file:``). Without one, a host other than loopback is a ConfigError (``run.metrics_host``)
    before anything binds (`rlbus.exposure`): containers bind ``0.0.0.0`` so Prometheus can reach them, and
    docker-compose.yml gives them the token."""
    from aiohttp import web

    token = token or load_token("metrics", environ=environ)
    check_bind(host, service="metrics", auth_configured=token is not None)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        # Liveness for supervisors (compose healthchecks, Kubernetes probes), which cannot send a secret:
        # an answer means the worker's event loop runs; it says nothing else, so it stays open.
        return web.json_response({"ok": True})

    auth = [BearerAuth("metrics", token, open_paths=("/healthz",)).middleware] if token is not None else []
    app = web.Application(middlewares=auth)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ServiceError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        bound = runner.addresses[0][1] if runner.addresses else port
        yield MetricsServer(host, int(bound), authenticated=token is not None)
    finally:
        await runner.cleanup()
