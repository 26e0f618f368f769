"""One process per role: ``rlbus worker prompts|rollout|reward|trainer --config run.toml``.

Each main is a thin builder — run config in, the worker classes of :mod:`rlbus.consumers` and
:mod:`rlbus.producers` out — around one ``asyncio.TaskGroup``, under :class:`GracefulStop` (the first
SIGTERM/SIGINT drains and exits 0, a second exits at once). torch is imported only by the rollout and
trainer mains: the prompt producer and the reward worker never load it.

Trainer start and restart. With ``trainer.checkpoint_dir`` holding a checkpoint, the trainer restores it
(weights, optimizer, step, RNG) and *relies on the committed offsets and the state store*, not on the
checkpoint's offsets: the trainer commits a message only after it is in the join buffer (Redis), groups
stay there until every rollout of them has an outcome (:mod:`rlbus.state.ordered`), and the outcome
ledger refuses a second outcome for a rollout — so resuming from the committed offsets loses nothing and
trains nothing twice. What a checkpoint older than the crash costs is the *model's* progress since it
(those rollouts are in the ledger as trained; their update is gone): checkpoint every step where that
matters; a graceful stop always writes one. Versions never repeat: when the restored checkpoint is not
the newest version the run has published (the ``trainer:version`` counter, or the newest manifest on
``rl.weights.latest.v1`` if that is higher), the trainer publishes its weights at once as the next
version, a keyframe, so every worker moves to the restored weights; when it is (a graceful stop, or a
checkpoint every step), the workers already hold those weights and nothing is published, so the rollouts
in flight do not age by a version. Without a checkpoint
it starts from ``model.checkpoint`` (`rlbus pretrain`) or a fresh policy warm-started for
``trainer.warm_steps`` steps, and publishes that as version 1.

Prompt numbering. The producer stamps every prompt with the run's sequence number (what the trainer
orders groups by) and keeps the count in the state store (``prompts:seq``), so a restarted producer
continues the numbering and the task stream where they were (its admission bound counts from the
trainer's version at its start, at least v1, see :class:`~rlbus.producers.prompts.PromptProducer`).

Admission. With ``trainer.admission = "served"`` (the default) the producer counts from the lowest version
the live rollout workers serve, read from the worker registry; each rollout worker beats as soon as it has
swapped a version in (:func:`beat_on_swap`), so the bound follows the fleet within ~50 ms, not a
heartbeat interval. :mod:`rlbus.producers.prompts` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.aio import wait_event
from rlbus.bus.base import Bus
from rlbus.errors import RlbusError
from rlbus.launch.build import bus_for, initial_policy, policy_config, state_for, store_for
from rlbus.launch.config import RunConfig, TrainerSection
from rlbus.launch.observed import Observed
from rlbus.launch.signals import GracefulStop
from rlbus.observe.runlog import RunLog
from rlbus.producers.prompts import Admission, PromptProducer, progress_from_state, task_prompts
from rlbus.state.base import StateStore
from rlbus.state.progress import PROMPT_SEQ, VERSION_COUNTER
from rlbus.weights.store import BlobStore

if TYPE_CHECKING:
    from rlbus.engines.torch_engine import TorchEngine
    from rlbus.models.policy import Policy
    from rlbus.observe.heartbeat import Heartbeat
    from rlbus.weights.sync import WeightSync

log = logging.getLogger("rlbus.launch.roles")

ROLES = ("prompts", "rollout", "reward", "trainer")


@contextlib.contextmanager
def stopping(stop: asyncio.Event | None) -> Iterator[asyncio.Event]:
    """The stop event: ``stop`` when the caller owns it (several roles in one process, tests), else
    the process's GracefulStop (signals)."""
    if stop is not None:
        yield stop
        return
    with GracefulStop() as graceful:
        yield graceful.stop


def observed(config: RunConfig, state: StateStore, role: str, worker_id: str, region: str | None,
             info: Callable[[], dict[str, Any]]) -> Observed:
    """The process's metrics endpoint, loop-lag monitor and registry heartbeat (run in its TaskGroup)."""
    run = config.run
    return Observed(state=state, role=role, worker_id=worker_id, region=region, info=info,
                    metrics_port=run.metrics_port, metrics_host=run.metrics_host, heartbeat_s=run.heartbeat_s)


def with_claims(bus: Bus, store: BlobStore, config: RunConfig) -> Bus:
    """``bus`` with claim checks: rollouts over ``run.claim_threshold_bytes`` ride as blob references."""
    from rlbus.bus.claimcheck import ClaimCheckBus

    return ClaimCheckBus(bus, store, threshold_bytes=config.run.claim_threshold_bytes)


def default_worker_id(role: str, region: str | None) -> str:
    """``<role>[-<region>]-<host>-<pid>``: unique per process, readable in logs and file names."""
    parts = [role, *([region] if region else []), socket.gethostname().split(".")[0], str(os.getpid())]
    return "-".join(parts)


# --- prompts -------------------------------------------------------------------------------------------
async def prompts_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None
) -> None:
    from rlbus.state.ordered import stamp

    task, trainer = config.task, config.trainer
    with stopping(stop) as stop:
        async with bus_for(config, region=region) as bus, state_for(config) as state:
            start = await state.get_counter(PROMPT_SEQ)
            source = task_prompts(task.env, seed=task.seed + 1000, group_size=task.group_size, config=task.env_config)
            producer = PromptProducer(
                bus=bus,
                prompts=stamp(itertools.islice(source, start, None), start),
                admission=admission_for(trainer),
                progress=progress_from_state(state, served_by="rollout" if trainer.admission == "served" else None),
                first_version=1,  # trainer_main publishes its initial weights as v1 before its first step
            )
            log.info("%s: producing %s prompts (G=%d) from seq %d", worker_id, task.env, task.group_size, start)
            done = asyncio.Event()

            async def produce() -> None:
                try:
                    await producer.run(stop)
                finally:
                    done.set()

            watch = observed(config, state, "prompts", worker_id, region, producer.stats)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(produce())
                tasks.create_task(_persist_count(state, lambda: start + producer.admitted, start, done))
                tasks.create_task(watch.run(done))


def admission_for(trainer: TrainerSection) -> Admission:
    """The producer's bound from the trainer's: a version is ``publish_every`` steps of ``groups_per_step``
    groups (counting steps as versions would stall the run once publish_every > max_staleness + 1)."""
    per_version = trainer.groups_per_step * trainer.publish_every
    return Admission(max_staleness=trainer.max_staleness, groups_per_step=per_version, slack=trainer.admission_slack)


async def _persist_count(state: StateStore, count: Callable[[], int], start: int, done: asyncio.Event) -> None:
    """Keep ``prompts:seq`` at the producer's count: every 0.2 s, and once more when the producer is done
    (after its last send, so a graceful stop never hands a sequence number out twice; a crash may, for
    the last 0.2 s — the ordering releases such twins together, at their number)."""
    stored = start
    while True:
        finished = done.is_set()
        now = count()
        if now > stored:
            await state.incr(PROMPT_SEQ, now - stored)
            stored = now
        if finished:
            return
        await wait_event(done, 0.2)


# --- reward ---------------------------------------------------------------------------------------------
async def reward_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None
) -> None:
    from rlbus.consumers.reward import RewardWorker

    with stopping(stop) as stop:
        store, _ = store_for(config)
        async with (
            store, with_claims(bus_for(config, region=region), store, config) as bus, state_for(config) as state
        ):
            worker = RewardWorker(bus=bus, kind=config.reward.kind, worker_id=worker_id,
                                  concurrency=config.reward.concurrency)
            log.info("%s: scoring rollouts (%s)", worker_id, config.reward.kind)
            watch = observed(config, state, "reward", worker_id, region, worker.stats)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(worker.run(stop))
                tasks.create_task(watch.run(stop))


# --- rollout --------------------------------------------------------------------------------------------
async def rollout_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None
) -> None:
    import torch

    from rlbus.consumers.rollout import RolloutWorker, episode_threads
    from rlbus.engines.batching import BatchingEngine
    from rlbus.engines.torch_engine import TorchEngine
    from rlbus.envs.chat import ChatFormat
    from rlbus.launch.recording import follow_syncs
    from rlbus.models.policy import Policy
    from rlbus.models.tokenizer import ByteTokenizer
    from rlbus.schemas import SamplingInfo
    from rlbus.weights.sync import WeightSync, bind_module, live_state

    settings = config.rollout
    torch.set_num_threads(settings.torch_threads)
    episode_threads(settings.episode_threads)
    with stopping(stop) as stop:
        weights = Policy(policy_config(config)).to(torch.bfloat16).eval()
        tokenizer = ByteTokenizer()
        seed = config.task.seed + 100 + zlib.crc32(worker_id.encode()) % 10_000
        engine = TorchEngine(weights, tokenizer=tokenizer, seed=seed, policy_version=0)
        store, _ = store_for(config)
        async with (
            store, with_claims(bus_for(config, region=region), store, config) as bus, state_for(config) as state
        ):
            sync = WeightSync(
                bus=bus, store=store, state=live_state(weights), bind=bind_module(weights),
                swap=engine.swap_point.apply, on_swap=_version_setter(engine), worker_id=worker_id,
            )
            worker = RolloutWorker(
                bus=bus, engine=BatchingEngine(engine, max_batch=settings.max_batch, window_s=settings.batch_window_s),
                chat=ChatFormat.for_byte_tokenizer(tokenizer), worker_id=worker_id, region=region or "",
                sampling=SamplingInfo(temperature=settings.temperature), prompts_in_flight=settings.prompts_in_flight,
            )
            runlog = RunLog(config.run_dir) if config.run_dir is not None else None
            watch = observed(config, state, "rollout", worker_id, region, lambda: {**worker.stats(), **sync.stats()})
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(watch.run(stop))
                    tasks.create_task(sync.run(stop))
                    tasks.create_task(beat_on_swap(sync, watch.heartbeat, stop))
                    if runlog is not None:
                        tasks.create_task(follow_syncs(sync, runlog, worker_id, stop))
                    log.info("%s (%s): waiting for the first weight version", worker_id, region or "no region")
                    while sync.version is None and not stop.is_set():  # noqa: ASYNC110 - a plain int
                        await asyncio.sleep(0.1)
                    if not stop.is_set():
                        log.info("%s: on v%s, joining the rollout group", worker_id, sync.version)
                        tasks.create_task(worker.run(stop))
            finally:
                if runlog is not None:
                    runlog.close()


async def beat_on_swap(sync: WeightSync, heartbeat: Heartbeat, stop: asyncio.Event, every_s: float = 0.05) -> None:
    """Send a registry heartbeat as soon as ``sync`` holds a new version, not at the next periodic beat:
    the prompt producer's admission counts from the lowest version the rollout workers serve
    (:mod:`rlbus.producers.prompts`), and each second it sees a swap late holds prompts back for nothing."""
    announced: int | None = None
    while not stop.is_set():
        if sync.version != announced:
            announced = sync.version
            await heartbeat.beat()
        await wait_event(stop, every_s)


def _version_setter(engine: TorchEngine) -> Callable[[int], None]:
    def set_version(version: int) -> None:
        engine.policy_version = version

    return set_version


# --- trainer --------------------------------------------------------------------------------------------
async def trainer_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None
) -> None:
    import torch

    from rlbus.consumers.trainer import Trainer, TrainerWorker
    from rlbus.launch.recording import TrainerRecorder
    from rlbus.models.policy import Policy
    from rlbus.state.join import JoinBuffer, RewardPolicy
    from rlbus.state.ordered import OrderedJoin
    from rlbus.training.checkpoint import load_checkpoint, policy_from_state
    from rlbus.training.step import GRPOConfig, OptimConfig
    from rlbus.weights.publish import WeightPublisher

    settings = config.trainer
    torch.set_num_threads(settings.torch_threads)
    torch.manual_seed(config.task.seed)
    started = time.monotonic()
    checkpoints = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
    with stopping(stop) as stop:
        saved = await asyncio.to_thread(load_checkpoint, checkpoints) if checkpoints and checkpoints.is_dir() else None
        if saved is not None:
            model = policy_from_state(saved)
            log.info("%s: restoring step %d (v%d) from %s", worker_id, saved.step, saved.version, checkpoints)
        elif config.model.checkpoint is not None:
            model = initial_policy(config)
            log.info("%s: starting from %s", worker_id, config.model.checkpoint)
        else:
            model = Policy(policy_config(config))
            if settings.warm_steps:
                log.info("%s: warm start, %d steps", worker_id, settings.warm_steps)
                await asyncio.to_thread(warm_start, model, config)
        store, store_url = store_for(config)
        async with store, with_claims(bus_for(config, region=region), store, config) as bus, state_for(config) as state:
            publisher = WeightPublisher(bus=bus, store=store, keyframe_every=settings.keyframe_every,
                                        retain_versions=settings.retain_versions, store_url=store_url)
            trainer = Trainer(
                model=model, optim=OptimConfig(lr=settings.lr),
                grpo=GRPOConfig(max_staleness=settings.max_staleness, normalize_std=settings.normalize_std),
                publisher=publisher, checkpoint_dir=checkpoints, publish_every=settings.publish_every,
                checkpoint_every=settings.checkpoint_every if checkpoints else 0,
                keep_checkpoints=settings.keep_checkpoints,
            )
            if saved is not None:
                await trainer.restore()
            newest = max(await state.get_counter(VERSION_COUNTER), await published_version(bus, publisher.model_id))
            if newest == 0 or trainer.version != newest:
                # Versions never repeat: the weights held here go out as the next version, a keyframe.
                trainer.version = publisher.version = max(trainer.version, newest)
                version = await trainer.publish()
                log.info("%s: published v%d (keyframe); training", worker_id, version)
            else:  # restored at the newest version: the workers hold these very weights already
                log.info("%s: resuming at step %d, v%d; training", worker_id, trainer.step, trainer.version)
            policy = RewardPolicy(sources=tuple(settings.reward_sources), timeout_s=settings.join_timeout_s)
            join = (OrderedJoin(state=state, policy=policy, batch=settings.groups_per_step) if settings.ordered
                    else JoinBuffer(state=state, policy=policy))
            runlog = RunLog(config.run_dir) if config.run_dir is not None else None
            recorder = None
            if runlog is not None:
                recorder = TrainerRecorder(runlog, publisher=publisher, extra=lambda: _join_stats(join))
                recorder.flush_weights()
            worker = TrainerWorker(bus=bus, trainer=trainer, join=join, state=state,
                                   groups_per_step=settings.groups_per_step, expire_every_s=0.2, on_train=recorder)
            watch = observed(config, state, "trainer", worker_id, region, worker.stats)
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(worker.run(stop))
                    tasks.create_task(watch.run(stop))
                if checkpoints is not None:
                    path = await worker.checkpoint()  # and settles the rollouts it holds
                    log.info("%s: stopped at step %d; checkpoint %s", worker_id, trainer.step, path)
                if runlog is not None:
                    outcomes = await join.counts()
                    runlog.summary({"worker": worker_id, "steps": trainer.step, "version": trainer.version,
                                    "outcomes": outcomes, "stale_fraction": stale_fraction(outcomes),
                                    "join": _join_stats(join), "wall_s": time.monotonic() - started})
            finally:
                if runlog is not None:
                    runlog.close()


async def published_version(bus: Bus, model_id: str) -> int:
    """The newest version of ``model_id`` announced on ``rl.weights.latest.v1`` (0 when none): a trainer
    whose state store is younger than the run's topics still never reuses a version number."""
    from rlbus.bus.replay import read_window
    from rlbus.bus.topics import WEIGHTS_LATEST

    newest = 0
    async for record in read_window(bus, WEIGHTS_LATEST.name):
        try:
            manifest = record.value
        except RlbusError:
            continue
        if manifest.model_id == model_id:
            newest = max(newest, manifest.version)
    return newest


def stale_fraction(outcomes: dict[str, int]) -> float:
    """Rollouts dropped as stale over rollouts with an outcome (duplicates are copies, not rollouts): the
    generation a run threw away because it arrived too many versions late."""
    from rlbus.state.join import Outcome

    settled = sum(n for name, n in outcomes.items() if name != Outcome.DUPLICATE)
    return round(outcomes.get(Outcome.STALE, 0) / settled, 4) if settled else 0.0


def _join_stats(join: Any) -> dict[str, Any]:
    stats: dict[str, Any] = join.stats() if hasattr(join, "stats") else {}
    return {f"join_{k}": v for k, v in stats.items()}


def warm_start(model: Policy, config: RunConfig) -> None:
    """Supervised warm start on reference solutions of the task, exactly as `rlbus demo` does; blocking."""
    from rlbus.demo import sft_examples, sloppy_teacher
    from rlbus.envs.base import env_for
    from rlbus.envs.chat import ChatFormat
    from rlbus.envs.tasks import generate_prompts
    from rlbus.models.tokenizer import ByteTokenizer
    from rlbus.training.sft import pretrain

    task, settings = config.task, config.trainer
    env: Any = env_for(generate_prompts(task.env, seed=0, n=1, config=task.env_config)[0])
    train = generate_prompts(task.env, seed=task.seed + 1, n=400, config=task.env_config)
    train = sloppy_teacher(train, settings.teacher_error, seed=task.seed)
    examples = sft_examples(env, train, ChatFormat.for_byte_tokenizer(ByteTokenizer()))
    pretrain(model, examples, steps=settings.warm_steps, lr=settings.warm_lr, batch_size=32, seed=task.seed)


MAINS = {"prompts": prompts_main, "rollout": rollout_main, "reward": reward_main, "trainer": trainer_main}


def run_role(role: str, config: RunConfig, *, region: str | None = None, worker_id: str | None = None) -> None:
    """Run one role's main until it stops (the CLI's ``rlbus worker <role>``)."""
    if role not in MAINS:
        raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
    asyncio.run(MAINS[role](config, worker_id=worker_id or default_worker_id(role, region), region=region))
