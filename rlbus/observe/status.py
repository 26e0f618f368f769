"""``rlbus status``: one snapshot of a running loop — who is alive where, how far behind each consumer
group is, where the trainer stands — rendered as rich tables, or as JSON for scripts.

Sources, all read-only: the worker registry in the state store (each worker's heartbeat: role, region,
host, throughput, policy version, recent swap pauses — :mod:`rlbus.observe.heartbeat`); the bus, for
each consumer group's committed offsets against the topics' end offsets (what ``kafka-consumer-groups
--describe`` calls lag; a partition the group never committed counts from the log start); the counters
the trainer keeps for admission control (``trainer:version``, ``trainer:groups_done``); and the
dead-letter topics' sizes. The groups shown are rlbus's own (``rollout``, ``reward-verifier``,
``trainer``) plus any group a live worker reports in its heartbeat (``reward-judge`` …).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from rlbus.bus.base import Bus
from rlbus.bus.topics import topic_specs
from rlbus.errors import TopicNotFound
from rlbus.observe.heartbeat import jsonable
from rlbus.observe.lag import DEFAULT_GROUPS, GroupLag, group_lag
from rlbus.state.base import StateStore, WorkerRecord
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER, VERSION_COUNTER


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    workers: list[WorkerRecord]
    lag: list[GroupLag]
    trainer: dict[str, Any]
    """``version`` and ``groups_done`` (state counters), plus ``step``/``last_step`` from its heartbeat."""
    dead_letters: dict[str, int]
    """Source topic → records in its dead-letter topic."""
    problems: list[str]

    def roles(self) -> dict[str, dict[str, int]]:
        """Live workers per role and region."""
        out: dict[str, dict[str, int]] = {}
        for worker in self.workers:
            region = str(worker["info"].get("region") or "-")
            by_region = out.setdefault(worker["role"], {})
            by_region[region] = by_region.get(region, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "taken_at": self.taken_at,
            "roles": self.roles(),
            "workers": [{**w, "age_s": self.taken_at - w["last_seen"]} for w in self.workers],
            "lag": [{**asdict(g), "total": g.total} for g in self.lag],
            "trainer": self.trainer,
            "dead_letters": self.dead_letters,
            "problems": self.problems,
        }
        result: dict[str, Any] = jsonable(out)
        return result


def _groups(workers: list[WorkerRecord], groups: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    wanted = {g: tuple(t) for g, t in groups.items()}
    for worker in workers:
        group, topics = worker["info"].get("group"), worker["info"].get("topics")
        if isinstance(group, str) and group and group not in wanted and isinstance(topics, list) and topics:
            wanted[group] = tuple(str(t) for t in topics)
    return wanted


async def take_snapshot(
    *,
    bus: Bus,
    state: StateStore,
    groups: Mapping[str, Sequence[str]] = DEFAULT_GROUPS,
    clock: Callable[[], float] = time.time,
) -> Snapshot:
    """Read the registry, the counters and every group's offsets once. A missing topic is reported in
    ``problems`` (the system may not be set up yet); an unreachable bus or store raises."""
    workers = await state.workers()
    wanted = _groups(workers, groups)
    problems: list[str] = []
    ends: dict[str, dict[int, int]] = {}
    starts: dict[str, dict[int, int]] = {}
    for topic in sorted({t for topics in wanted.values() for t in topics}):
        try:
            ends[topic] = await bus.end_offsets(topic)
            starts[topic] = await bus.beginning_offsets(topic)
        except TopicNotFound as exc:
            problems.append(str(exc))
    lag: list[GroupLag] = []
    for group, topics in sorted(wanted.items()):
        members = sum(1 for w in workers if w["info"].get("group") == group)
        for topic in topics:
            if topic not in ends:
                continue
            lag.append(await group_lag(bus, group, topic, members=members, ends=ends[topic], starts=starts[topic]))

    trainer: dict[str, Any] = {
        "version": await state.get_counter(VERSION_COUNTER),
        "groups_done": await state.get_counter(GROUPS_DONE_COUNTER),
        "groups_freed": await state.get_counter(GROUPS_FREED_COUNTER),
    }
    beats = [w for w in workers if w["role"] == "trainer"]
    if beats:
        info = max(beats, key=lambda w: w["last_seen"])["info"]
        trainer.update(
            worker=info.get("worker_id"), step=info.get("step"), heartbeat_version=info.get("version"),
            last_step=info.get("last_step") or {},
        )

    dead: dict[str, int] = {}
    for spec in topic_specs():
        if not spec.name.endswith(".dlq"):
            continue
        try:
            d_ends, d_starts = await bus.end_offsets(spec.name), await bus.beginning_offsets(spec.name)
        except TopicNotFound:
            continue
        dead[spec.name.removesuffix(".dlq")] = sum(d_ends.values()) - sum(d_starts.values())
    return Snapshot(clock(), workers, lag, trainer, dead, problems)


# --- rendering ------------------------------------------------------------------------------------
def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def _notes(role: str, info: Mapping[str, Any]) -> str:
    parts: list[str] = []
    if role == "trainer":
        last = info.get("last_step") or {}
        parts.append(f"step {info.get('step', '-')}")
        parts.append(f"kl {_num(last.get('kl_k3'), '.2e')}")
        parts.append(f"ess {_num(last.get('is_ess'), '.2f')}")
        parts.append(f"reward {_num(last.get('reward_mean'), '.3f')}")
        hacked = last.get("hacked")
        if isinstance(hacked, int | float) and hacked > 0:  # rollouts whose rewards report reward hacking
            parts.append(f"[yellow]hacked {hacked:.0%}[/yellow]")
    pauses = [p for p in info.get("swap_pause_ms") or [] if isinstance(p, int | float)]
    if pauses:
        parts.append(f"swap ms last {pauses[-1]:.2f} max {max(pauses):.2f} ({len(pauses)})")
    if "scored" in info:
        parts.append(f"scored {info['scored']}")
    hacks = {k: v for k, v in (info.get("hacks") or {}).items() if isinstance(v, int) and v}
    if hacks:  # the reward worker's hack monitor counts (rlbus/envs/swe/grading/monitor.py), and what it does to them
        kinds = " ".join(f"{k} {v}" for k, v in sorted(hacks.items()))
        parts.append(f"[yellow]hacks {kinds} ({info.get('hack_policy', '?')})[/yellow]")
    if "admitted" in info:
        parts.append(f"admitted {info['admitted']} waits {info.get('waits', 0)} "
                     f"(sync {info.get('sync_waits', 0)}) from v{info.get('reference_version', '-')}, "
                     f"freed {info.get('freed', 0)}")
    if info.get("dead_letters"):
        parts.append(f"[red]dlq {info['dead_letters']}[/red]")
    if info.get("status") == "stopping":
        parts.append("[yellow]stopping[/yellow]")
    return ", ".join(parts)


def render(snapshot: Snapshot) -> RenderableType:
    """The snapshot as a header line and tables: workers, consumer lag, dead letters, problems."""
    t = snapshot.trainer
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at))
    roles = "; ".join(
        f"{role} {sum(r.values())} ({', '.join(f'{k} {v}' for k, v in sorted(r.items()))})"
        for role, r in sorted(snapshot.roles().items())
    )
    header = Text.from_markup(
        f"[bold]rlbus status[/bold] {when}  trainer [bold]v{t['version']}[/bold] step {t.get('step', '-')}, "
        f"{t['groups_done']} groups done ({t.get('groups_freed', 0)} untrained, slots freed)\n"
        f"workers: {roles or 'none registered'}"
    )

    workers = Table(title="workers", title_justify="left")
    for name in ("role", "worker", "region", "host:pid", "up", "seen", "per s", "version", "lag"):
        workers.add_column(name, no_wrap=True)
    workers.add_column("notes", overflow="fold")
    for w in snapshot.workers:
        info = w["info"]
        workers.add_row(
            w["role"], w["worker_id"], str(info.get("region") or "-"),
            f"{info.get('host', '?')}:{info.get('pid', '?')}",
            _ago(float(info.get("uptime_s") or 0)), _ago(snapshot.taken_at - w["last_seen"]),
            _num(info.get("throughput"), ".2f"), str(info.get("version", "-")), str(info.get("lag", "-")),
            _notes(w["role"], info),
        )

    lag = Table(title="consumer lag (end − committed)", title_justify="left")
    for name in ("group", "topic", "live", "parts", "committed", "end", "lag", "worst"):
        lag.add_column(name, no_wrap=True)
    for g in snapshot.lag:
        committed = [p.committed for p in g.partitions if p.committed is not None]
        worst = g.worst
        lag.add_row(
            g.group, g.topic, str(g.members), str(len(g.partitions)),
            str(sum(committed)) if committed else "never", str(sum(p.end for p in g.partitions)),
            f"[bold red]{g.total}[/bold red]" if g.total else "0",
            f"[{worst.partition}] {worst.lag}" if worst is not None and worst.lag else "-",
        )

    parts: list[RenderableType] = [header, workers, lag]
    dead = {k: v for k, v in snapshot.dead_letters.items() if v}
    parts.append(
        Text.from_markup("dead letters: " + ", ".join(f"[red]{k} {v}[/red]" for k, v in sorted(dead.items())))
        if dead else Text("dead letters: none")
    )
    parts += [Text.from_markup(f"[red]problem:[/red] {p}") for p in snapshot.problems]
    return Group(*parts)


async def show(
    bus: Bus, state: StateStore, *, console: Console, as_json: bool = False, watch: bool = False, every_s: float = 2.0
) -> Snapshot:
    """What the CLI does: print one snapshot (JSON or tables), or with ``watch`` refresh a live view
    every ``every_s`` seconds until cancelled (Ctrl-C). Returns the last snapshot."""
    import json

    snapshot = await take_snapshot(bus=bus, state=state)
    if as_json:
        console.file.write(json.dumps(snapshot.to_json(), indent=2) + "\n")
        return snapshot
    if not watch:
        console.print(render(snapshot))
        return snapshot
    from rich.live import Live

    with Live(render(snapshot), console=console, refresh_per_second=4) as live:
        while True:
            await asyncio.sleep(every_s)
            snapshot = await take_snapshot(bus=bus, state=state)
            live.update(render(snapshot))
