"""One process per role: ``rlbus worker prompts|rollout|reward|trainer --config run.toml``.

Each main is a thin builder — run config in, the worker classes of :mod:`rlbus.consumers` and
:mod:`rlbus.producers` out — around one ``asyncio.TaskGroup``, under :class:`GracefulStop` (the first
SIGTERM/SIGINT drains and exits 0, a second exits at once). torch is imported only by the rollout and
trainer mains: the prompt producer and the reward worker never load it.

Trainer start and restart. With ``trainer.checkpoint_dir`` holding a checkpoint, the trainer restores it
(weights, optimizer, step, RNG) and *relies on the committed offsets and the state store*, not on the
checkpoint's offsets: the trainer commits a message only after it is in the join buffer (Redis), groups
stay there until every rollout of them has an outcome (:mod:`rlbus.training.ordered`), and the outcome
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
import logging
import os
import socket
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.aio import wait_any, wait_event
from rlbus.blobs.base import BlobStore
from rlbus.blobs.failover import FailoverStore
from rlbus.bus.base import Bus
from rlbus.errors import ConfigError, RlbusError
from rlbus.launch.arguments import (
    bus_for,
    claims_for,
    initial_model,
    model_source,
    producer_args,
    reward_args,
    rollout_args,
    state_for,
    store_for,
    trainer_args,
    warm_start_args,
)
from rlbus.launch.config import RunConfig
from rlbus.launch.observed import Observed
from rlbus.launch.signals import GracefulStop
from rlbus.observe.runlog import PROMPTS as PROMPTS_LOG
from rlbus.observe.runlog import RunLog
from rlbus.state.base import StateStore
from rlbus.state.progress import PROMPT_SEQ, VERSION_COUNTER
from rlbus.wiring.producer import prompt_producer

if TYPE_CHECKING:
    from rlbus.observe.heartbeat import Heartbeat
    from rlbus.training.ranks import Ranks
    from rlbus.weights.sync import WeightSync

#: How often the trainer's join applies its timeout and releases complete groups (the simulator models it).
JOIN_EXPIRE_EVERY_S = 0.2
log = logging.getLogger("rlbus.launch.roles")

ROLES = ("prompts", "rollout", "reward", "trainer", "serve")


@contextlib.contextmanager
def stopping(stop: asyncio.Event | None) -> Iterator[asyncio.Event]:
    """The stop event: ``stop`` when the caller owns it (several roles in one process, tests), else
    the process's GracefulStop (signals)."""
    if stop is not None:
        yield stop
        return
    with GracefulStop() as graceful:
        yield graceful.stop


@contextlib.asynccontextmanager
async def connected(
    config: RunConfig, region: str | None, *, bus: Bus | None, state: StateStore | None, store: BlobStore | None,
    claims: bool = True,
) -> AsyncIterator[tuple[Bus, StateStore, BlobStore | None, str]]:
    """The role's bus, state store and blob store, entered: the ones given (a caller wiring several roles
    in one process, tests), else the run config's. With ``claims`` (and a store) the bus does claim checks."""
    store_url = ""
    if store is None and claims:
        store, store_url = store_for(config)
    bus = bus if bus is not None else bus_for(config, region=region)
    state = state if state is not None else state_for(config)
    async with contextlib.AsyncExitStack() as stack:
        if store is not None:
            await stack.enter_async_context(store)
            if claims:
                bus = claims_for(config, bus, store)
        await stack.enter_async_context(bus)
        await stack.enter_async_context(state)
        yield bus, state, store, store_url


def observed(config: RunConfig, state: StateStore, role: str, worker_id: str, region: str | None,
             info: Callable[[], dict[str, Any]]) -> Observed:
    """The process's metrics endpoint, loop-lag monitor and registry heartbeat (run in its TaskGroup)."""
    run = config.run
    return Observed(state=state, role=role, worker_id=worker_id, region=region, info=info,
                    metrics_port=run.metrics_port, metrics_host=run.metrics_host, heartbeat_s=run.heartbeat_s)


def default_worker_id(role: str, region: str | None) -> str:
    """``<role>[-<region>]-<host>-<pid>``: unique per process, readable in logs and file names."""
    parts = [role, *([region] if region else []), socket.gethostname().split(".")[0], str(os.getpid())]
    return "-".join(parts)


# --- prompts -------------------------------------------------------------------------------------------
async def prompts_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None,
    bus: Bus | None = None, state: StateStore | None = None,
) -> None:
    """The prompt producer. ``bus`` and ``state`` replace the run config's (unstarted; entered here)."""
    task = config.task
    with stopping(stop) as stop:
        async with connected(config, region, bus=bus, state=state, store=None, claims=False) as (bus, state, _, _):
            start = await state.get_counter(PROMPT_SEQ)
            producer = prompt_producer(
                bus=bus, state=state, **producer_args(config), start=start,
                served_by="rollout" if config.trainer.admission == "served" else None,
                first_version=1,  # trainer_main publishes its initial weights as v1 before its first step
            )
            source = f"the file {task.prompts}" if task.prompts is not None else f"{task.env} prompts"
            log.info("%s: producing %s (G=%d) from seq %d", worker_id, source, task.group_size, start)
            done = asyncio.Event()
            runlog = RunLog(config.run_dir) if config.run_dir is not None else None
            if runlog is not None:
                producer.on_admit = lambda prompt: runlog.write(PROMPTS_LOG, {
                    "prompt_id": prompt.prompt_id, "created_at": prompt.created_at, "version": prompt.policy_version})

            async def produce() -> None:
                try:
                    await producer.run(stop)
                finally:
                    done.set()

            watch = observed(config, state, "prompts", worker_id, region, producer.stats)
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(produce())
                    tasks.create_task(_persist_count(state, lambda: start + producer.admitted, start, done))
                    tasks.create_task(watch.run(done))
            finally:
                if runlog is not None:
                    runlog.close()


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
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None,
    bus: Bus | None = None, state: StateStore | None = None, store: BlobStore | None = None,
) -> None:
    """The reward worker. ``bus``, ``state`` and ``store`` replace the run config's (unstarted)."""
    from rlbus.wiring.reward import reward_worker

    with stopping(stop) as stop:
        async with connected(config, region, bus=bus, state=state, store=store) as (bus, state, _, _):
            worker = reward_worker(bus=bus, worker_id=worker_id, **reward_args(config))
            log.info("%s: scoring rollouts (%s)", worker_id, config.reward.kind)
            watch = observed(config, state, "reward", worker_id, region, worker.stats)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(worker.run(stop))
                tasks.create_task(watch.run(stop))


# --- rollout --------------------------------------------------------------------------------------------
async def rollout_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None,
    bus: Bus | None = None, state: StateStore | None = None, store: BlobStore | None = None,
) -> None:
    """A rollout worker. ``bus``, ``state`` and ``store`` replace the run config's (unstarted)."""
    import torch

    from rlbus.consumers.rollout import episode_threads
    from rlbus.launch.recording import RolloutRecorder, follow_syncs
    from rlbus.wiring.rollout import rollout_stack

    settings = config.rollout
    torch.set_num_threads(settings.torch_threads)
    episode_threads(settings.episode_threads)
    with stopping(stop) as stop:
        async with connected(config, region, bus=bus, state=state, store=store) as (bus, state, store, _):
            source = await asyncio.to_thread(model_source, config, progress=log.info)
            runlog = RunLog(config.run_dir) if config.run_dir is not None else None
            parts = rollout_stack(
                bus=bus, store=store, model=source, worker_id=worker_id, region=region or "",
                seed=config.task.seed + 100 + zlib.crc32(worker_id.encode()) % 10_000, **rollout_args(config),
                on_rollout=RolloutRecorder(runlog, worker_id) if runlog is not None else None,
            )
            sync, worker = parts.sync, parts.worker
            assert sync is not None
            failovers = (lambda: {"blob_failovers": store.failovers}) if isinstance(store, FailoverStore) else dict
            watch = observed(config, state, "rollout", worker_id, region,
                             lambda: {**worker.stats(), **sync.stats(), **failovers()})
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(watch.run(stop))
                    tasks.create_task(sync.run(stop))
                    tasks.create_task(beat_on_swap(sync, watch.heartbeat, stop))
                    if runlog is not None:
                        tasks.create_task(follow_syncs(sync, runlog, worker_id, stop))
                    log.info("%s (%s): waiting for the first weight version", worker_id, region or "no region")
                    await wait_any(sync.ready, stop)
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


# --- trainer --------------------------------------------------------------------------------------------
async def trainer_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None,
    bus: Bus | None = None, state: StateStore | None = None, store: BlobStore | None = None,
) -> None:
    """The trainer. ``bus``, ``state`` and ``store`` replace the run config's (unstarted). Under torchrun with
    ``[trainer] world_size`` ranks, rank 0 runs what follows and the other ranks `follow_leader`."""
    import torch

    from rlbus.training.ranks import join_ranks, leave_ranks

    settings = config.trainer
    torch.set_num_threads(settings.torch_threads)
    torch.manual_seed(config.task.seed)
    try:
        ranks = join_ranks(settings.world_size)
    except ValueError as exc:
        raise ConfigError("trainer.world_size", str(exc)) from exc
    try:
        if ranks is not None and not ranks.leader:
            await follow_leader(config, ranks, worker_id=worker_id, stop=stop)
        else:
            await _lead(config, ranks, worker_id=worker_id, region=region, stop=stop, bus=bus, state=state,
                        store=store)
    finally:
        leave_ranks(ranks)


async def follow_leader(config: RunConfig, ranks: Ranks, *, worker_id: str, stop: asyncio.Event | None = None) -> None:
    """A trainer rank > 0: build the leader's model (its description, then its weights, come from rank 0),
    shard it, and run rank 0's commands until it releases the ranks. It never touches the bus or the state
    store, nor the blob store unless ``[trainer] rank_uploads`` has it upload the weight chunks it encodes
    (`rlbus.training.shard_publish`). A SIGTERM reaches every rank under torchrun: the followers keep
    following (rank 0's drain still needs them for its last checkpoint) and leave when rank 0 says so."""
    import torch

    from rlbus.models.sources import model_from_description
    from rlbus.training.shard_publish import ShardPublisher
    from rlbus.wiring.trainer import follower_trainer

    settings = config.trainer
    checkpoints = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
    with stopping(stop):
        async with contextlib.AsyncExitStack() as stack:
            shards = None
            if settings.rank_uploads:
                store = await stack.enter_async_context(store_for(config)[0])
                shards = ShardPublisher(store=store, loop=asyncio.get_running_loop())
            description, dpo = await asyncio.to_thread(ranks.broadcast)
            model = await asyncio.to_thread(model_from_description, description, dtype=torch.float32)
            if dpo:
                model = await asyncio.to_thread(sharded_dpo, model, config, ranks, worker_id)
            trainer = follower_trainer(model=model, lr=settings.lr, grpo=settings.grpo, ranks=ranks,
                                       fsdp=settings.fsdp, checkpoint_dir=checkpoints, shards=shards)
            log.info("%s: rank %d of %d, following rank 0", worker_id, ranks.rank, ranks.world)
            await asyncio.to_thread(trainer.follow)


async def _lead(
    config: RunConfig, ranks: Ranks | None, *, worker_id: str, region: str | None, stop: asyncio.Event | None,
    bus: Bus | None, state: StateStore | None, store: BlobStore | None,
) -> None:
    """The trainer of one process, or rank 0 of N: the only one on the bus."""
    from rlbus.launch.recording import TrainerRecorder
    from rlbus.training.checkpoint import load_checkpoint, model_from_state
    from rlbus.wiring.trainer import trainer_stack

    settings = config.trainer
    started = time.monotonic()
    checkpoints = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
    with stopping(stop) as stop:
        saved = await asyncio.to_thread(load_checkpoint, checkpoints) if checkpoints and checkpoints.is_dir() else None
        model: Any
        # On N ranks the run's DPO stage trains sharded, on every rank (`sharded_dpo`).
        dpo = ranks is not None and saved is None and config.model.checkpoint is None and config.dpo.train.steps > 0
        if saved is not None:
            model = model_from_state(saved)
            log.info("%s: restoring step %d (v%d) from %s", worker_id, saved.step, saved.version, checkpoints)
        else:
            model = await asyncio.to_thread(starting_model, config, worker_id, with_dpo=not dpo)
        if ranks is not None:  # the followers build this model, then take its weights (trainer_stack)
            await asyncio.to_thread(ranks.broadcast, (model.describe(), dpo))
        if dpo and ranks is not None:
            model = await asyncio.to_thread(sharded_dpo, model, config, ranks, worker_id)
        async with connected(config, region, bus=bus, state=state, store=store) as (bus, state, store, store_url):
            runlog = RunLog(config.run_dir) if config.run_dir is not None else None
            recorder: TrainerRecorder | None = None  # needs the stack's publisher and join: made just below

            def record(groups: list[Any], metrics: dict[str, Any]) -> None:
                if recorder is not None:
                    recorder(groups, metrics)

            parts = trainer_stack(
                bus=bus, state=state, store=store, store_url=store_url, model=model,
                checkpoint_dir=checkpoints, expire_every_s=JOIN_EXPIRE_EVERY_S, **trainer_args(config),
                on_train=record if runlog is not None else None, ranks=ranks,
            )
            trainer, publisher, join, worker = parts.trainer, parts.publisher, parts.join, parts.worker
            try:  # rank 0's commands keep the other ranks until it releases them
                assert publisher is not None
                if runlog is not None:
                    recorder = TrainerRecorder(runlog, publisher=publisher, extra=lambda: _join_stats(join),
                                               join=join)
                if saved is not None:
                    await trainer.restore()
                newest = max(await state.get_counter(VERSION_COUNTER),
                             await published_version(bus, publisher.model_id))
                if newest == 0 or trainer.version != newest:
                    # Versions never repeat: the weights held here go out as the next version, a keyframe.
                    trainer.continue_after(newest)
                    version = await trainer.publish()
                    log.info("%s: published v%d (keyframe); training", worker_id, version)
                else:  # restored at the newest version: the workers hold these very weights already
                    log.info("%s: resuming at step %d, v%d; training", worker_id, trainer.step,
                             trainer.version)
                if recorder is not None:
                    recorder.flush_weights()
                watch = observed(config, state, "trainer", worker_id, region, worker.stats)
                try:
                    async with asyncio.TaskGroup() as tasks:
                        tasks.create_task(worker.run(stop))
                        tasks.create_task(watch.run(stop))
                    await trainer.drain()  # a graceful stop lets the version in flight be announced
                    if checkpoints is not None:
                        path = await worker.checkpoint()  # and settles the rollouts it holds
                        log.info("%s: stopped at step %d; checkpoint %s", worker_id, trainer.step, path)
                    if recorder is not None:  # that version's line, which no step wrote
                        recorder.flush_weights()
                    if runlog is not None:
                        outcomes = await join.counts()
                        runlog.summary({"worker": worker_id, "steps": trainer.step, "version": trainer.version,
                                        "outcomes": outcomes, "stale_fraction": stale_fraction(outcomes),
                                        "join": _join_stats(join), "wall_s": time.monotonic() - started})
                finally:
                    if runlog is not None:
                        runlog.close()
            finally:
                trainer.release()


def _dpo_stage(model: Any, source: Any, config: RunConfig, worker_id: str) -> None:
    """The run's DPO stage after the warm start (`rlbus.training.offline`); raises `QualityGateFailed` when
    the held-out preference accuracy misses ``dpo.gate_accuracy`` (RL then never starts). Blocking."""
    from rlbus.launch.stages import prepare_dpo
    from rlbus.training.offline import dpo_stage

    pairs, held_out, dpo, gate = prepare_dpo(config, source)
    log.info("%s: DPO, %d steps on %d pairs (%d held out)", worker_id, dpo.steps, len(pairs), len(held_out))
    report = dpo_stage(model, pairs, held_out, dpo, gate_accuracy=gate)
    log.info("%s: DPO done: held-out preference accuracy %s → %s (gate %s)", worker_id, report.accuracy_start,
             report.accuracy_end, gate or "off")


def sharded_dpo(model: Any, config: RunConfig, ranks: Ranks, worker_id: str) -> Any:
    """The run's DPO stage on N ranks: ``model`` (rank 0's weights shared to every rank first) sharded as
    the trainer shards it, then `rlbus.training.dpo.train_dpo` with ``ranks`` — each rank draws the same
    pairs from the config and trains its slice of each batch, so no rank holds more than its shard of the
    weights and Adam moments. Returns the sharded model, which the trainer then takes as it is. The gate
    is checked on every rank alike (the metrics are the whole batch's), so all of them stop when it
    fails. Every rank calls this at the same point. Blocking."""
    from rlbus.launch.stages import prepare_dpo
    from rlbus.training.offline import dpo_stage
    from rlbus.wiring.trainer import _sharded

    model = _sharded(model, ranks, config.trainer.fsdp)
    source = model_source(config, progress=log.info)
    pairs, held_out, dpo, gate = prepare_dpo(config, source)
    log.info("%s: DPO on rank %d of %d, %d steps on %d pairs (%d held out)", worker_id, ranks.rank, ranks.world,
             dpo.steps, len(pairs), len(held_out))
    report = dpo_stage(model, pairs, held_out, dpo, gate_accuracy=gate, ranks=ranks)
    log.info("%s: DPO done: held-out preference accuracy %s → %s (gate %s)", worker_id, report.accuracy_start,
             report.accuracy_end, gate or "off")
    return model


def starting_model(config: RunConfig, worker_id: str, *, with_dpo: bool = True) -> Any:
    """The model RL starts from when the trainer has no checkpoint of its own: ``[model] checkpoint``, else
    the run's model with its warm start (``[trainer] warm_steps``) and DPO stage (``[dpo.train] steps``).
    Deterministic for a config (seeded by ``[task] seed``), so `rlbus eval` rebuilds the same one to
    measure where RL started. ``with_dpo=False`` leaves the DPO stage out (a trainer on N ranks runs it
    sharded: `sharded_dpo`). Blocking."""
    import torch

    from rlbus.training.warm import warm_start

    settings = config.trainer
    torch.manual_seed(config.task.seed)
    if config.model.checkpoint is not None:
        log.info("%s: starting from %s", worker_id, config.model.checkpoint)
        return initial_model(config)
    source = model_source(config, progress=log.info)
    model = source.build(seed=config.task.seed)
    log.info("%s: model %s (%s)", worker_id, source.label, source.kind)
    if settings.warm_steps:
        log.info("%s: warm start, %d steps", worker_id, settings.warm_steps)
        total, every = settings.warm_steps, max(1, settings.warm_steps // 10)

        def progress(step: int, loss: float) -> None:
            if (step + 1) % every == 0 or step + 1 == total:
                log.info("%s: warm start step %d/%d, loss %.4f", worker_id, step + 1, total, loss)

        warm_start(model, chat=source.chat, on_step=progress, **warm_start_args(config))
    if config.dpo.train.steps and with_dpo:
        _dpo_stage(model, source, config, worker_id)
    return model


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
    from rlbus.training.join import Outcome

    settled = sum(n for name, n in outcomes.items() if name != Outcome.DUPLICATE)
    return round(outcomes.get(Outcome.STALE, 0) / settled, 4) if settled else 0.0


def _join_stats(join: Any) -> dict[str, Any]:
    stats: dict[str, Any] = join.stats() if hasattr(join, "stats") else {}
    return {f"join_{k}": v for k, v in stats.items()}


# --- serve ---------------------------------------------------------------------------------------------
async def serve_main(
    config: RunConfig, *, worker_id: str, region: str | None = None, stop: asyncio.Event | None = None,
    bus: Bus | None = None, state: StateStore | None = None, store: BlobStore | None = None,
    model: str | None = None, port: int | None = None, token_file: Path | None = None,
) -> None:
    """The OpenAI-compatible gateway of a run (rlbus/serve/): the run's model on a rollout stack whose
    weights follow the trainer, recording on the run's bus. ``model``/``port``/``token_file`` override
    the config's (``rlbus serve --config``)."""
    import torch

    from rlbus.models.sources import parse_model
    from rlbus.serve.auth import load_tenants
    from rlbus.serve.stack import run_serve, serve_stack

    s = config.serve
    torch.set_num_threads(config.rollout.torch_threads)
    tenants = load_tenants(token_file or (Path(s.token_file) if s.token_file else None))
    with stopping(stop) as stop:
        async with connected(config, region, bus=bus, state=state, store=store) as (bus, state, store, _):
            source = await asyncio.to_thread(
                lambda: parse_model(model, progress=log.info) if model else model_source(config, progress=log.info))
            parts = serve_stack(
                bus=bus, source=source, tenants=tenants, store=store, worker_id=worker_id, region=region or "",
                model_name=s.model_name or (Path(model).name if model else None),
                seed=config.task.seed + 7 + zlib.crc32(worker_id.encode()) % 10_000,
                max_batch=s.max_batch, batch_window_s=config.rollout.batch_window_s,
                max_staleness=config.trainer.grpo.max_staleness, max_open_sessions=s.max_open_sessions,
                user_sessions=s.user_sessions, buffer_records=s.buffer_records, default_max_tokens=s.default_max_tokens,
            )
            gateway, sync = parts.gateway, parts.rollout.sync

            def info() -> dict[str, Any]:
                return {**(sync.stats() if sync is not None else {}), **gateway.stats()}

            watch = observed(config, state, "serve", worker_id, region, info)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(watch.run(stop))
                tasks.create_task(run_serve(parts, stop, host=s.host, port=s.port if port is None else port))


MAINS = {"prompts": prompts_main, "rollout": rollout_main, "reward": reward_main, "trainer": trainer_main,
         "serve": serve_main}


def run_role(role: str, config: RunConfig, *, region: str | None = None, worker_id: str | None = None) -> None:
    """Run one role's main until it stops (the CLI's ``rlbus worker <role>``)."""
    if role not in MAINS:
        raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
    asyncio.run(MAINS[role](config, worker_id=worker_id or default_worker_id(role, region), region=region))
