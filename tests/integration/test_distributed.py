"""The distributed mode over real Kafka and Redis, every role its own `rlbus worker` process: a blob
server, the trainer, a reward worker, two rollout workers in different regions and the prompt producer,
on fresh topics and Redis keys (the run's namespace). It runs until the trainer has published versions
beyond the first and both regions have generated with them, stops everything with SIGTERM, and checks:

* every process drained and exited 0; the trainer left a checkpoint of its last step;
* versions propagate: rollouts from both regions carry policy versions > 1, and each worker's run log
  shows the deltas it swapped in;
* every rollout carries a policy version for each token it sampled (−1 elsewhere);
* nothing was trained twice: the trained rollout ids are unique and the ledger caught no second training;
* every rollout produced is accounted for: trained + dropped (per reason) + dead-lettered + still in the
  join buffer = the distinct rollouts on the topic;
* the stale fraction is reported: the trainer's summary.json carries the outcome counts and the fraction
  dropped as stale, and the producer's heartbeat the version its admission counts from (the lowest one the
  rollout workers serve).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlbus.bus.base import Bus
from rlbus.bus.namespace import NamespacedBus
from rlbus.bus.replay import read_window
from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS, topic_specs
from rlbus.observe.runlog import INPUTS, STEPS, read, syncs_name
from rlbus.schemas import Rollout
from rlbus.state import RedisStateStore
from rlbus.state.progress import PROMPT_SEQ, outcome_counter
from rlbus.training.checkpoint import load_checkpoint
from rlbus.training.join import Outcome
from rlbus.training.ordered import buffered_rollouts
from rlbus_tools.services import free_port
from tests.conftest import KAFKA_BOOTSTRAP, kafka_bus

RLBUS = str(Path(sys.executable).with_name("rlbus"))
REGIONS = ("eu-west", "us-east")
RUN_DEADLINE_S = 90.0


class Proc:
    """A child process whose output goes to a file (read while it runs, kept for a failing test)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.terminated = False
        self.log = logs / f"{name}.log"
        with self.log.open("w") as out:
            self.popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Send ``sig``; SIGTERM only once (a second one would mean "exit at once")."""
        if self.popen.poll() is None and not (sig == signal.SIGTERM and self.terminated):
            self.popen.send_signal(sig)
            self.terminated = self.terminated or sig == signal.SIGTERM

    async def stopped(self, timeout_s: float = 60.0) -> int:
        self.signal()
        try:
            return await asyncio.to_thread(self.popen.wait, timeout_s)
        except subprocess.TimeoutExpired:
            tail = self.text()[-3000:]
            raise AssertionError(f"{self.name} did not drain within {timeout_s:.0f} s:\n{tail}") from None


async def eventually(check: Callable[[], Any], what: str, timeout_s: float, procs: list[Proc]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        dead = [p for p in procs if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} (exit {p.popen.poll()})\n{p.text()[-2500:]}" for p in procs)
            raise AssertionError(f"{'a process died' if dead else 'timed out'} waiting for {what}\n{tails}")
        await asyncio.sleep(1.0)


def synced_generation(text: str, group: str) -> int | None:
    found = re.findall(rf"Successfully synced group {re.escape(group)} with generation (\d+)", text)
    return int(found[-1]) if found else None


async def all_rollouts(bus: Bus) -> list[Rollout]:
    return [record.value async for record in read_window(bus, ROLLOUTS.name)]


async def caught_up(bus: Bus, group: str, topics: list[str]) -> bool:
    for topic in topics:
        ends = await bus.end_offsets(topic)
        committed = await bus.committed(group, topic)
        if any((committed.get(p) or 0) < end for p, end in ends.items()):
            return False
    return True


def max_version(rollout: Rollout) -> int:
    return int(rollout.token_versions.to_numpy().max())


@pytest.mark.slow
async def test_two_regions_reward_and_trainer_as_processes(redis_url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    namespace = f"it-{uuid.uuid4().hex[:8]}"
    inner = await kafka_bus()
    bus = NamespacedBus(inner, f"{namespace}.")
    await bus.create_topics(topic_specs(partitions=4))
    port = free_port()
    (tmp_path / "run.toml").write_text(f"""
[bus]
bootstrap = "{KAFKA_BOOTSTRAP}"
[state]
url = "{redis_url}"
[store]
url = "http://127.0.0.1:{port}"
[task]
group_size = 4
[model]
d_model = 64
n_layer = 2
d_ff = 64
[trainer]
groups_per_step = 2
warm_steps = 10
join_timeout_s = 120.0
checkpoint_dir = "{tmp_path / 'checkpoints'}"
checkpoint_every = 2
[dpo]
task_pairs = 40
[dpo.train]
steps = 3
batch_size = 8
[rollout]
episode_threads = 16
[run]
run_dir = "{tmp_path / 'run'}"
namespace = "{namespace}"
""")
    env = {**os.environ, "RLBUS_BLOB_SECRET": uuid.uuid4().hex, "RLBUS_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()
    config = ["--config", str(tmp_path / "run.toml")]
    procs: list[Proc] = []

    def spawn(name: str, *args: str) -> Proc:
        procs.append(Proc(name, [RLBUS, *args], env, logs))
        return procs[-1]

    state = RedisStateStore.from_url(redis_url, key_prefix=f"rlbus:{namespace}:")
    try:
        blobs = spawn("blobs", "blobs", "serve", "--root", str(tmp_path / "blobs"), "--port", str(port))
        trainer = spawn("trainer", "worker", "trainer", *config, "--worker-id", "trainer")
        reward = spawn("reward", "worker", "reward", *config, "--worker-id", "reward-0")
        rollouts = [spawn(f"rollout-{r}", "worker", "rollout", *config, "--region", r, "--worker-id", f"rollout-{r}")
                    for r in REGIONS]

        # Prompts start once both rollout workers share one group generation: no rebalance mid-prompt.
        async def one_generation() -> bool:
            gens = {synced_generation(p.text(), f"{namespace}.rollout") for p in rollouts}
            return len(gens) == 1 and None not in gens

        await eventually(one_generation, "both rollout workers in the rollout group", RUN_DEADLINE_S, procs)
        prompts = spawn("prompts", "worker", "prompts", *config, "--worker-id", "prompts")

        async def propagated() -> bool:
            steps = list(read(tmp_path / "run", STEPS))
            if not steps or steps[-1]["version"] < 4:
                return False
            newest = {r: 0 for r in REGIONS}
            for rollout in await all_rollouts(bus):
                newest[rollout.region] = max(newest[rollout.region], max_version(rollout))
            return all(v > 1 for v in newest.values())

        await eventually(propagated, "v4 and rollouts of both regions past v1", RUN_DEADLINE_S, procs)
        # the offline stages ran first (SFT → DPO, no gate), then RL from their weights, v1 a keyframe
        assert "warm start step 10/10" in trainer.text() and "DPO done" in trainer.text(), trainer.text()[-2000:]
        assert "published v1 (keyframe)" in trainer.text()

        # `rlbus status` sees the run: every role by region, the trainer's version, lag per group.
        shown = await asyncio.to_thread(
            subprocess.run,
            [RLBUS, "status", "--json", "--namespace", namespace, "--redis", redis_url, "--bootstrap", KAFKA_BOOTSTRAP],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert shown.returncode == 0, shown.stderr
        snapshot = json.loads(shown.stdout)
        assert snapshot["roles"]["rollout"] == {region: 1 for region in REGIONS}
        assert {"trainer", "reward", "prompts"} <= set(snapshot["roles"]), snapshot["roles"]
        assert snapshot["trainer"]["version"] >= 4 and not snapshot["problems"], snapshot
        assert {g["group"] for g in snapshot["lag"]} >= {"rollout", "trainer", "reward-verifier"}
        beats = {w["worker_id"]: w["info"] for w in snapshot["workers"]}
        assert beats["rollout-eu-west"]["version"] >= 2 and "swap_pause_ms" in beats["rollout-eu-west"]
        assert beats["prompts"]["reference_version"] >= 1 and beats["prompts"]["sync_waits"] >= 0

        # Stop upstream first, let reward and trainer consume everything, then stop them.
        assert await prompts.stopped() == 0
        for worker in rollouts:  # both at once: one leaving first would rebalance the other mid-prompt
            worker.signal()
        for worker in rollouts:
            assert await worker.stopped() == 0, worker.text()[-3000:]

        async def drained() -> bool:
            return await caught_up(bus, "reward-verifier", [ROLLOUTS.name]) and await caught_up(
                bus, "trainer", [ROLLOUTS.name, REWARDS.name])

        await eventually(drained, "reward worker and trainer to catch up", 60, [reward, trainer])
        assert await reward.stopped() == 0, reward.text()[-3000:]
        assert await trainer.stopped() == 0, trainer.text()[-3000:]
        blobs.signal()

        # --- what the run left behind --------------------------------------------------------------
        produced = await all_rollouts(bus)
        ids = {r.rollout_id for r in produced}
        steps = list(read(tmp_path / "run", STEPS))
        final = steps[-1]
        saved = load_checkpoint(tmp_path / "checkpoints")
        assert saved is not None and saved.step == final["step"] and saved.version == final["version"]

        # Versions propagate, per region and in each worker's swap log.
        for region in REGIONS:
            mine = [r for r in produced if r.region == region]
            assert mine and max(max_version(r) for r in mine) > 1, f"{region} never generated past v1"
            assert {r.worker_id for r in mine} == {f"rollout-{region}"}
            swaps = list(read(tmp_path / "run", syncs_name(f"rollout-{region}")))
            assert swaps[0]["version"] == 1 and swaps[0]["kind"] == "keyframe"
            assert any(s["version"] >= 2 and s["kind"] == "delta" for s in swaps)

        # Every sampled token carries the version that produced it; the rest carry −1.
        for rollout in produced:
            versions, mask = rollout.token_versions.to_numpy(), rollout.loss_mask.to_numpy().astype(bool)
            assert versions.shape == rollout.token_ids.to_numpy().shape
            assert mask.any() and np.all(versions[mask] >= 1) and np.all(versions[mask] <= final["version"])
            assert np.all(versions[~mask] == -1)

        # Nothing trained twice.
        trained = [i for e in read(tmp_path / "run", INPUTS) for g in e["groups"] for i in g["rollout_ids"]]
        assert len(trained) == len(set(trained)) and set(trained) <= ids
        counts = {o.value: await state.get_counter(outcome_counter(o)) for o in Outcome}
        assert counts[Outcome.TRAINED] == len(trained) == sum(s["rollouts"] for s in steps)
        assert await state.get_counter("ledger:trained_again") == 0
        for rollout_id in trained:
            assert await state.seen(Outcome.TRAINED, rollout_id)

        # Every rollout accounted for.
        pending = {i for group in (await buffered_rollouts(state)).values() for i in group}
        assert not pending & set(trained)
        settled = counts[Outcome.TRAINED] + counts[Outcome.STALE] + counts[Outcome.TIMED_OUT] + counts[
            Outcome.INCOMPLETE] + counts[Outcome.DEAD_LETTERED]
        assert settled + len(pending) == len(ids), (counts, len(pending), len(ids))
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["outcomes"] == counts and summary["stale_fraction"] == round(counts[Outcome.STALE] / settled, 4)
        prompts_made = sum((await bus.end_offsets(PROMPTS.name)).values())
        assert await state.get_counter(PROMPT_SEQ) == prompts_made
        print(f"\n{len(ids)} rollouts ({len(produced) - len(ids)} redelivered copies) from {prompts_made} prompts: "
              f"{counts} ({summary['stale_fraction']:.1%} stale), {len(pending)} pending; "
              f"{final['step']} steps → v{final['version']}; "
              f"{time.monotonic() - started:.0f} s")
    finally:
        for proc in procs:
            proc.signal(signal.SIGKILL)
        await state.close()
        await inner.close()


@pytest.mark.slow
async def test_a_restarted_run_continues_where_it_stopped(redis_url: str, tmp_path: Path) -> None:
    """Every role stopped at once mid-run (SIGTERM-equivalent), then started again on the same topics, Redis
    keys and checkpoint directory (in this process, so torch loads once): the trainer resumes from its
    checkpoint, versions and prompt numbers continue without repeats, groups keep their order, and at the
    end every rollout of both lives is accounted for, none trained twice."""
    from rlbus.launch.config import config_from_dict
    from rlbus.launch.roles import prompts_main, reward_main, rollout_main, trainer_main
    from rlbus.observe.runlog import WEIGHTS

    namespace = f"it-{uuid.uuid4().hex[:8]}"
    inner = await kafka_bus()
    bus = NamespacedBus(inner, f"{namespace}.")
    await bus.create_topics(topic_specs(partitions=3))
    run_dir = tmp_path / "run"
    config = config_from_dict(
        {
            "bus": {"bootstrap": KAFKA_BOOTSTRAP},
            "state": {"url": redis_url},
            "task": {"group_size": 4},
            "model": {"d_model": 64, "n_layer": 2, "d_ff": 64},
            "trainer": {"groups_per_step": 2, "warm_steps": 0, "join_timeout_s": 120.0,
                        "checkpoint_dir": str(tmp_path / "checkpoints"), "checkpoint_every": 100},
            "rollout": {"episode_threads": 16},
            "run": {"run_dir": str(run_dir), "namespace": namespace},
        },
        {},
    )
    state = RedisStateStore.from_url(redis_url, key_prefix=f"rlbus:{namespace}:")

    async def steps_reach(n: int) -> bool:
        return len(list(read(run_dir, STEPS))) >= n

    async def life(steps: int, staged: bool) -> None:
        upstream, downstream = asyncio.Event(), asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(trainer_main(config, worker_id="trainer", stop=downstream))
            tasks.create_task(reward_main(config, worker_id="reward", stop=downstream))
            ups = [tasks.create_task(rollout_main(config, worker_id="rollout", region="eu-west", stop=upstream)),
                   tasks.create_task(prompts_main(config, worker_id="prompts", stop=upstream))]
            try:
                await eventually(lambda: steps_reach(steps), f"{steps} steps", RUN_DEADLINE_S, [])
                upstream.set()
                if staged:  # let everything produced be scored and joined before the trainer stops
                    await asyncio.gather(*ups)

                    async def drained() -> bool:
                        return await caught_up(bus, "reward-verifier", [ROLLOUTS.name]) and await caught_up(
                            bus, "trainer", [ROLLOUTS.name, REWARDS.name])

                    await eventually(drained, "reward worker and trainer to catch up", 60, [])
            finally:
                upstream.set()
                downstream.set()

    try:
        await life(2, staged=False)
        first = list(read(run_dir, STEPS))
        saved = load_checkpoint(tmp_path / "checkpoints")
        assert saved is not None and saved.step == first[-1]["step"] and saved.version == first[-1]["version"]
        stopped_at = time.time()

        await life(len(first) + 2, staged=True)
        steps = list(read(run_dir, STEPS))
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))  # resumed at the checkpoint's step
        versions = [w["version"] for w in read(run_dir, WEIGHTS)]
        assert versions == list(range(1, len(versions) + 1))  # never a version twice
        # Restored at the newest version (a graceful stop checkpoints), so nothing was re-announced; the
        # restarted publisher's first version is a keyframe (it holds no base for a delta).
        after = next(w for w in read(run_dir, WEIGHTS) if w["version"] == first[-1]["version"] + 1)
        assert after["kind"] == "keyframe" and after["t"] > stopped_at
        assert steps[len(first)]["version"] == first[-1]["version"] + 1

        groups = [g for e in read(run_dir, INPUTS) for g in e["groups"]]
        trained = [i for g in groups for i in g["rollout_ids"]]
        assert len(trained) == len(set(trained))
        assert [g["seq"] for g in groups] == sorted({g["seq"] for g in groups})
        prompts = [r.value async for r in read_window(bus, PROMPTS.name)]
        assert sorted(int(p.metadata["seq"]) for p in prompts) == list(range(len(prompts)))
        assert await state.get_counter(PROMPT_SEQ) == len(prompts)

        ids = {r.rollout_id for r in await all_rollouts(bus)}
        counts = {o.value: await state.get_counter(outcome_counter(o)) for o in Outcome}
        pending = {i for group in (await buffered_rollouts(state)).values() for i in group}
        assert counts[Outcome.TRAINED] == len(trained) and not pending & set(trained)
        settled = sum(counts[o] for o in (Outcome.TRAINED, Outcome.STALE, Outcome.TIMED_OUT, Outcome.INCOMPLETE,
                                          Outcome.DEAD_LETTERED))
        assert settled + len(pending) == len(ids), (counts, len(pending), len(ids))
        assert await state.get_counter("ledger:trained_again") == 0
    finally:
        await state.close()
        await inner.close()
