"""Infrastructure faults under load: a Kafka broker SIGKILLed and restarted, Redis SIGKILLed and restarted.

*Broker.* One of three brokers dies without a clean shutdown while prompts, rollouts and rewards flow.
With RF 3, ``min.insync.replicas`` 2 and idempotent ``acks=all`` producers, every acknowledged write
is on two live replicas, leadership moves to them, producers retry into the new leaders without
duplicating (sequence numbers), and group coordinators move too. The loop must keep making progress
while the broker is down, the broker must rejoin the ISR when it returns, and the ledger must show
nothing lost and nothing trained twice.

*Redis.* The state store (join buffer, exactly-once ledger, counters) dies with SIGKILL and starts again
on the same directory. Its append-only file is fsynced on every write, so it comes back with every
write it acknowledged; the clients reconnect (redis-py retries connection errors with backoff) and the
join resumes. The audit shows the buffer and the ledger recovered: a group buffered before the crash
still trains, and no rollout is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import time

from rlbus_tools.chaos.harness import Run, run_scenario
from rlbus_tools.chaos.ledger import ScenarioReport
from rlbus_tools.chaos.pipeline import PipelineConfig
from rlbus_tools.chaos.rig import ChaosRig


async def broker_kill(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    config = PipelineConfig.seeded(seed, prompts=20 if quick else 40)
    victim = 1 + seed % len(rig.cluster.nodes)
    down_s = 15.0 if quick else 20.0  # past the controller's 9 s broker session timeout: leaders move

    async def fault(run: Run) -> None:
        before = await run.wait_outcomes(0.25)
        killed_at = time.monotonic()
        pid = await asyncio.to_thread(rig.kill_broker, victim)
        run.report.faults.append(f"SIGKILL broker {victim} (pid {pid}) at {before}/{run.pipeline.expected} outcomes")
        await asyncio.sleep(down_s)
        during = run.progress.count_at(time.monotonic()) - run.progress.count_at(killed_at)
        run.report.check("progress while a broker was down", during > 0)
        run.report.extra["outcomes_while_down"] = during
        restarted_at = time.monotonic()
        await asyncio.to_thread(rig.restart_brokers)
        run.report.faults.append(f"restart broker {victim} after {restarted_at - killed_at:.1f} s")
        isr_s = await _wait_full_isr(run, timeout_s=90)
        run.report.check("every partition back to 3 in-sync replicas", isr_s is not None)
        run.report.extra["isr_restored_s"] = None if isr_s is None else round(isr_s, 2)
        await asyncio.sleep(5)  # the stall, if any, may outlast the restart
        run.report.recovery_s = run.progress.longest_stall(killed_at, time.monotonic())
        run.report.notes.append("recovery = the longest time without a new outcome in the ledger, from the kill "
                                "until 5 s after the restart (the controller fences a dead broker after 9 s)")

    return await run_scenario(rig, "broker_kill", config=config, fault=fault)


async def _wait_full_isr(run: Run, timeout_s: float) -> float | None:
    """Seconds until every partition of every rlbus topic has all its replicas in sync again."""
    began = time.monotonic()
    bus = run.pipeline.bus
    names = [t for t in await bus.list_topics() if t.startswith("rl.")]
    while time.monotonic() - began < timeout_s:
        topics = await bus.admin.describe_topics(names)  # type: ignore[attr-defined]
        if all(len(p["isr"]) == len(p["replicas"]) for t in topics for p in t["partitions"]):
            return time.monotonic() - began
        await asyncio.sleep(0.5)
    return None


async def redis_restart(rig: ChaosRig, *, seed: int = 0, quick: bool = False) -> ScenarioReport:
    config = PipelineConfig.seeded(seed, prompts=20 if quick else 40)
    down_s = 1.0

    async def fault(run: Run) -> None:
        await run.wait_outcomes(0.3)
        state = run.pipeline.state
        open_before = len(await state.get_fields("join:open"))  # the join's default namespace
        counted_before = await run.pipeline.outcomes()
        killed_at = time.monotonic()
        await asyncio.to_thread(rig.kill_redis)
        run.report.faults.append(f"SIGKILL redis at {counted_before}/{run.pipeline.expected} outcomes "
                                 f"({open_before} groups buffered)")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(rig.restart_redis)
        run.report.faults.append(f"restart redis on its AOF after {time.monotonic() - killed_at:.1f} s")
        counted_after = await run.pipeline.outcomes()
        run.report.check("ledger counts survived the crash", counted_after >= counted_before)
        run.report.extra.update(outcomes_before_kill=counted_before, outcomes_after_restart=counted_after,
                                groups_buffered_at_kill=open_before)
        await run.progress.wait_recovery(killed_at, timeout_s=60)
        run.report.recovery_s = run.progress.longest_stall(killed_at, time.monotonic())
        run.report.notes.append("recovery = the longest time without a new outcome in the ledger, from the kill "
                                "until the first outcome after the restart (includes the outage)")

    return await run_scenario(rig, "redis_restart", config=config, fault=fault)
