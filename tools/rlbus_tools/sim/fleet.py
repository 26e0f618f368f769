"""The fleet file: what ``rlbus sim`` simulates, as one TOML file (every table rejects unknown fields and
every error names the field, like the run config).

::

    [sim]        duration_s, seed, warmup_s (figures count from here), sync_baseline (also run sync)
    [model]      params, active_params, bytes_per_param (inference dtype: 1 = FP8, 2 = bf16), lr,
                 delta_fraction (a measured size instead of the codec curve), keyframe_every,
                 decode_bytes_per_s (a worker's stage rate), swap_pause_s
    [trainer]    region, step_s, step_cv, world_size, encode_bytes_per_s (per rank), egress_gbps,
                 groups_per_step, group_size, publish_every, max_staleness, admission, slack,
                 prompts_in_flight_cap, publish_latency_s, counter_delay_s, release_every_s
    [episode]    tokens_median, tokens_sigma (log-normal), max_tokens, turns, tool_s, setup_s
    [reward]     workers, verifier_s, judge_fraction, judge_s
    [bus]        latency_s (a produce → consume hop), prompt_s, prompt_sigma, join_s, join_sigma, producer_poll_s,
                 session_timeout_s,
                 heartbeat_s
    [[region]]   name, workers, tokens_per_s (per worker, at `concurrency` sequences), concurrency,
                 groups_in_flight, wan_gbps, wan_latency_ms (to the trainer's region), relay, lan_gbps
    [traffic]    share (of each worker's capacity serving production), profile = [[hour, multiplier], …]
    [autoscale]  enabled, lag_per_worker, min_workers, max_workers, poll_s, cold_start_s
    [[fault]]    kind = "region_down" (region, at_s, for_s) | "preemption" (rate_per_worker_hour, restart_s)

Units are seconds, bytes, tokens and Gbit/s unless a name says otherwise. Defaults describe a small
GPU fleet; ``infra/sim/composer2.toml`` is the seeds' 1T-parameter scenario and
:func:`rlbus_tools.sim.calibrate.fleet_from_run` writes one from a real ``rlbus up`` run.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlbus.config import parse
from rlbus.errors import ConfigError

_STRUCT: dict[str, Any] = {"forbid_unknown_fields": True, "kw_only": True}


class SimSection(msgspec.Struct, **_STRUCT):
    #: Simulated seconds.
    duration_s: float = 6 * 3600.0
    seed: int = 0
    #: Figures (rates, staleness, utilisation) count from the first trainer step after this time.
    warmup_s: float = 0.0
    #: Also simulate the synchronous loop on the same fleet (the baseline of ``async_vs_sync_speedup``).
    sync_baseline: bool = True

    def __post_init__(self) -> None:
        _require(self.duration_s > 0, "duration_s must be > 0")
        _require(0 <= self.warmup_s < self.duration_s, "warmup_s must be in [0, duration_s)")


class ModelSection(msgspec.Struct, **_STRUCT):
    params: float = 8e9
    #: Parameters a token uses (MoE); the trainer's and generator's costs are given directly, so this only
    #: labels the report.
    active_params: float | None = None
    #: Bytes per parameter in the inference dtype the deltas are cast to (FP8: 1, bf16: 2).
    bytes_per_param: float = 2.0
    #: Learning rate, for the codec's measured delta-size curve (:data:`CODEC_CURVE`).
    lr: float = 3e-6
    #: A delta's size as a fraction of the full inference-dtype weights; overrides the curve.
    delta_fraction: float | None = None
    #: Keyframe size as a fraction of the full weights (the codec's measured 67.4 % of bf16).
    keyframe_fraction: float = 0.674
    keyframe_every: int = 10
    #: Bytes of delta (or keyframe) a worker downloads-decodes-verifies per second once they are local.
    decode_bytes_per_s: float = 2e9
    #: Measured seconds to stage a delta (a calibration writes them; used instead of the rate for deltas).
    stage_samples: list[float] | None = None
    #: Seconds a worker stops generating to swap staged weights in.
    swap_pause_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("params", "bytes_per_param", "lr", "decode_bytes_per_s"):
            _require(getattr(self, name) > 0, f"{name} must be > 0")
        _require(self.delta_fraction is None or 0 < self.delta_fraction <= 1, "delta_fraction must be in (0, 1]")
        _require(0 < self.keyframe_fraction <= 1, "keyframe_fraction must be in (0, 1]")
        _require(self.keyframe_every >= 1, "keyframe_every must be >= 1")
        _require(self.swap_pause_s >= 0, "swap_pause_s must be >= 0")

    @property
    def full_bytes(self) -> float:
        return self.params * self.bytes_per_param


class TrainerSection(msgspec.Struct, **_STRUCT):
    region: str = "trainer"
    #: Mean seconds of one optimizer step over ``groups_per_step`` groups (all ranks together).
    step_s: float = 60.0
    #: Coefficient of variation of the step time (gamma distributed).
    step_cv: float = 0.05
    world_size: int = 8
    #: Bytes of weights each rank casts and delta-encodes per second (sharded publishing: ranks in parallel).
    encode_bytes_per_s: float = 2e9
    #: The origin blob store's egress, shared by every transfer leaving the trainer's region.
    egress_gbps: float = 100.0
    groups_per_step: int = 8
    group_size: int = 8
    #: Steps per published version.
    publish_every: int = 1
    max_staleness: int = 2
    #: "served": admission counts from the lowest version a live worker serves; "published": from the
    #: trainer's (``[trainer] admission`` of the run config).
    admission: Literal["served", "published"] = "served"
    slack: int = 0
    #: Cap on admitted-but-unfinished groups (None: only the staleness bound).
    prompts_in_flight_cap: int | None = None
    #: Seconds from a publish to the manifest reaching consumers (announce, commit).
    publish_latency_s: float = 0.05
    #: The ordered join releases complete groups this often (the trainer's ``expire`` call; 0: at once).
    release_every_s: float = 0.2
    #: Seconds from the end of a step (and its publish) to admission seeing it: the ledger's writes, then
    #: the state store's counters (version, groups done), then the producer's next read.
    counter_delay_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("step_s", "encode_bytes_per_s", "egress_gbps"):
            _require(getattr(self, name) > 0, f"{name} must be > 0")
        for name in ("world_size", "groups_per_step", "group_size", "publish_every"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in ("step_cv", "max_staleness", "publish_latency_s", "counter_delay_s", "release_every_s"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0")
        _require(0 <= self.slack <= self.max_staleness, f"slack must be in 0..max_staleness ({self.max_staleness})")
        _require(
            self.prompts_in_flight_cap is None or self.prompts_in_flight_cap >= self.groups_per_step,
            f"prompts_in_flight_cap must be >= groups_per_step ({self.groups_per_step}): the join releases whole "
            "batches, so a smaller cap never fills one",
        )


class EpisodeSection(msgspec.Struct, **_STRUCT):
    #: Sampled tokens per episode: log-normal with this median and log-space sigma (heavy-tailed).
    tokens_median: float = 2000.0
    tokens_sigma: float = 1.0
    max_tokens: int = 32768
    #: Model turns per episode; each turn after the first waits ``tool_s`` for its tool call.
    turns: int = 1
    tool_s: float = 0.0
    #: Seconds to open the episode's world (sandbox start) before the first token.
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        _require(self.tokens_median > 0, "tokens_median must be > 0")
        for name in ("max_tokens", "turns"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in ("tokens_sigma", "tool_s", "setup_s"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0")


class RewardSection(msgspec.Struct, **_STRUCT):
    #: Reward-worker slots scoring in parallel (each scores one rollout at a time).
    workers: int = 16
    verifier_s: float = 0.01
    #: Share of rollouts an LM judge also scores, and its seconds per rollout.
    judge_fraction: float = 0.0
    judge_s: float = 5.0

    def __post_init__(self) -> None:
        _require(self.workers >= 1, "workers must be >= 1")
        for name in ("verifier_s", "judge_s"):
            _require(getattr(self, name) >= 0, f"{name} must be >= 0")
        _require(0 <= self.judge_fraction <= 1, "judge_fraction must be in [0, 1]")


class BusSection(msgspec.Struct, **_STRUCT):
    #: Seconds of one produce → consume hop (batching, linger, a fetch's wait).
    latency_s: float = 0.02
    #: Seconds from admission to a free worker holding the prompt (the prompts topic's hop and the
    #: worker's fetch wait); None: ``latency_s``.
    prompt_s: float | None = None
    #: Log-space sigma of that hop (log-normal around ``prompt_s``; 0: always ``prompt_s``).
    prompt_sigma: float = 0.0
    #: Measured hops to draw from instead (a calibration writes them): the real distribution's shape.
    prompt_samples: list[float] | None = None
    #: Seconds from a group's last rollout to the trainer holding it, scoring aside (rollouts → reward
    #: worker → rewards → the join's buffer → released); None: two hops of ``latency_s``.
    join_s: float | None = None
    #: Log-space sigma of that trip (log-normal around ``join_s``; 0: always ``join_s``).
    join_sigma: float = 0.0
    join_samples: list[float] | None = None
    #: Seconds the producer spends per admitted prompt (its counter reads and the awaited send): a window
    #: that opens admits its prompts one after another, not all at once.
    admit_s: float = 0.0
    #: The prompt producer re-reads admission's inputs this often while it is held back.
    producer_poll_s: float = 0.05
    #: Seconds before the consumer group gives a vanished worker's prompts to another (Kafka's
    #: ``session.timeout.ms``, 45 s by default).
    session_timeout_s: float = 45.0
    #: A silent worker leaves the registry (and stops bounding admission) after five heartbeats.
    heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("latency_s", "prompt_s", "prompt_sigma", "join_s", "join_sigma", "producer_poll_s", "admit_s",
                     "session_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"{name} must be >= 0")
        for name in ("prompt_samples", "join_samples"):
            samples = getattr(self, name)
            _require(samples is None or all(x >= 0 for x in samples), f"{name} must hold seconds >= 0")

    @property
    def prompt_hop_s(self) -> float:
        return self.latency_s if self.prompt_s is None else self.prompt_s

    @property
    def join_hop_s(self) -> float:
        return 2 * self.latency_s if self.join_s is None else self.join_s


class RegionSection(msgspec.Struct, **_STRUCT):
    name: str
    #: Rollout workers (inference engines) at the start.
    workers: int = 8
    #: A worker's decode throughput in tokens/s when ``concurrency`` sequences are in flight.
    tokens_per_s: float = 20000.0
    concurrency: int = 256
    #: Prompts (groups) a worker plays at once; default: as many as ``concurrency`` sequences hold.
    groups_in_flight: int | None = None
    #: The link between this region and the trainer's (one direction's bandwidth, one-way latency).
    wan_gbps: float = 10.0
    wan_latency_ms: float = 50.0
    #: A pull-through blob relay: each chunk crosses the WAN once per region instead of once per worker.
    relay: bool = True
    #: Bandwidth inside the region (relay → worker).
    lan_gbps: float = 100.0

    def __post_init__(self) -> None:
        _require(bool(self.name), "name must be set")
        _require(self.workers >= 0, "workers must be >= 0")
        for name in ("tokens_per_s", "wan_gbps", "lan_gbps"):
            _require(getattr(self, name) > 0, f"{name} must be > 0")
        _require(self.concurrency >= 1, "concurrency must be >= 1")
        _require(self.groups_in_flight is None or self.groups_in_flight >= 1, "groups_in_flight must be >= 1")
        _require(self.wan_latency_ms >= 0, "wan_latency_ms must be >= 0")


class TrafficSection(msgspec.Struct, **_STRUCT):
    #: Share of each worker's capacity production traffic takes at multiplier 1 (0: no served traffic).
    share: float = 0.0
    #: Daily profile: [hour, multiplier] points, linearly interpolated and repeated every 24 h.
    profile: list[tuple[float, float]] = msgspec.field(default_factory=lambda: [(0.0, 1.0)])
    #: Production never takes more than this share, whatever the multiplier (RL keeps a floor).
    max_share: float = 0.9

    def __post_init__(self) -> None:
        _require(0 <= self.share < 1, "share must be in [0, 1)")
        _require(0 < self.max_share < 1, "max_share must be in (0, 1)")
        _require(bool(self.profile) and all(0 <= h <= 24 and m >= 0 for h, m in self.profile),
                 "profile must be [[hour 0..24, multiplier >= 0], …] with at least one point")

    def share_at(self, t_s: float) -> float:
        if self.share == 0:
            return 0.0
        hour = (t_s / 3600.0) % 24.0
        points = sorted(self.profile)
        points = [(points[-1][0] - 24.0, points[-1][1]), *points, (points[0][0] + 24.0, points[0][1])]
        for (h0, m0), (h1, m1) in itertools.pairwise(points):
            if h0 <= hour <= h1:
                weight = 0.0 if h1 == h0 else (hour - h0) / (h1 - h0)
                return min(self.max_share, self.share * (m0 + weight * (m1 - m0)))
        return min(self.max_share, self.share)


class AutoscaleSection(msgspec.Struct, **_STRUCT):
    """KEDA's Kafka scaler on the prompts topic: desired workers = ceil(lag / lag_per_worker), clamped."""

    enabled: bool = False
    lag_per_worker: float = 4.0
    min_workers: int = 1
    max_workers: int = 64
    poll_s: float = 30.0
    #: Seconds from a scale-up decision to a new worker generating (container, engine start; the first
    #: keyframe's download comes on top, over the region's links).
    cold_start_s: float = 120.0

    def __post_init__(self) -> None:
        _require(self.lag_per_worker > 0, "lag_per_worker must be > 0")
        _require(self.min_workers >= 0, "min_workers must be >= 0")
        _require(self.max_workers >= max(1, self.min_workers), "max_workers must be >= 1 and >= min_workers")
        _require(self.poll_s > 0, "poll_s must be > 0")
        _require(self.cold_start_s >= 0, "cold_start_s must be >= 0")


class FaultSection(msgspec.Struct, **_STRUCT):
    kind: Literal["region_down", "preemption"]
    region: str | None = None
    at_s: float = 0.0
    for_s: float = 0.0
    rate_per_worker_hour: float = 0.0
    #: Seconds a preempted worker needs before it starts again (its keyframe download comes on top).
    restart_s: float = 300.0

    def __post_init__(self) -> None:
        if self.kind == "region_down":
            _require(self.region is not None, "region must name the region a region_down fault cuts")
            _require(self.at_s >= 0, "at_s must be >= 0")
            _require(self.for_s > 0, "for_s must be > 0 for a region_down fault")
        else:
            _require(self.rate_per_worker_hour > 0, "rate_per_worker_hour must be > 0 for a preemption fault")
            _require(self.restart_s >= 0, "restart_s must be >= 0")


class Fleet(msgspec.Struct, **_STRUCT):
    sim: SimSection = msgspec.field(default_factory=SimSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    episode: EpisodeSection = msgspec.field(default_factory=EpisodeSection)
    reward: RewardSection = msgspec.field(default_factory=RewardSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    region: list[RegionSection] = msgspec.field(default_factory=lambda: [RegionSection(name="region-0")])
    traffic: TrafficSection = msgspec.field(default_factory=TrafficSection)
    autoscale: AutoscaleSection = msgspec.field(default_factory=AutoscaleSection)
    fault: list[FaultSection] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        names = [r.name for r in self.region]
        _require(bool(names) and len(set(names)) == len(names), "region must list at least one region, each name once")
        for fault in self.fault:
            _require(fault.region is None or fault.region in names,
                     f"fault names region {fault.region!r}, which is not one of {names}")

    def delta_fraction(self, version: int) -> float:
        """A delta's size as a fraction of the full weights at ``version`` (the codec curve's step)."""
        if self.model.delta_fraction is not None:
            return self.model.delta_fraction
        return codec_fraction(self.model.lr, max(1, version - 1) * self.trainer.publish_every)

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result


#: ``rlbus bench codec``'s measured delta sizes (bench/RESULTS.md "codec": fp32 master weights, Adam, bf16
#: casts of a real 22.7 M-parameter model), in % of the full bf16 model: {lr: {step: %}}. A delta's share
#: of changed elements depends on the step's update size relative to each weight's bf16 spacing, not on
#: the model's size, which is why a small model's curve is used for a large one; steps past 10 hold the
#: step-10 size (Adam's update scale has settled by then).
CODEC_CURVE: dict[float, dict[int, float]] = {
    1e-6: {1: 0.79, 5: 0.38, 10: 0.29},
    3e-6: {1: 1.61, 5: 0.84, 10: 0.66},
    1e-5: {1: 3.42, 5: 1.96, 10: 1.56},
}


def codec_fraction(lr: float, step: int) -> float:
    """The codec curve at (lr, step), interpolated log-log in both and clamped to the measured range."""
    lrs = sorted(CODEC_CURVE)
    x = min(max(math.log(lr), math.log(lrs[0])), math.log(lrs[-1]))

    def at_lr(curve: dict[int, float]) -> float:
        steps = sorted(curve)
        s = min(max(math.log(step), math.log(steps[0])), math.log(steps[-1]))
        return _interp(s, [(math.log(k), math.log(curve[k])) for k in steps])

    y = _interp(x, [(math.log(k), at_lr(CODEC_CURVE[k])) for k in lrs])
    return math.exp(y) / 100.0


def _interp(x: float, points: list[tuple[float, float]]) -> float:
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.0)
    return points[0][1] if x < points[0][0] else points[-1][1]


def _require(condition: bool, message: str) -> None:
    """A failed check; the message starts with the field's name, which is how ``parse`` names the field."""
    if not condition:
        raise ValueError(message)


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet file; a bad field is a ConfigError naming it."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("fleet", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("fleet", f"{path} is not valid TOML: {exc}") from None
    return fleet_from_dict(data)


def fleet_from_dict(data: dict[str, Any]) -> Fleet:
    fleet: Fleet = parse(Fleet, data, prefix="")
    return fleet
