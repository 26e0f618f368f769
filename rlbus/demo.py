"""``rlbus demo``: the whole asynchronous RL loop in one process, on CPU, in a few minutes.

Every role runs as its own asyncio task on the embedded bus (:class:`rlbus.bus.memory.MemoryBus`), a
local-directory blob store and the in-memory state store — the same classes the distributed mode runs
against Kafka, Redis and the HTTP blob store:

* a small MoE policy is warm-started ("mid-training", `rlbus.training.warm`) on worked solutions of a
  built-in verifiable task from a *sloppy teacher*: on ``trainer.teacher_error`` of the examples (55 % in
  the demo's run config, `DEMO_RUN`) the teacher's answer is off by one. The warm-started policy learns the
  arithmetic and the teacher's habit with it, so its greedy answer is usually the habit (20–40 % right)
  while the right answer is among its samples — the
  situation RL with a verifier is for: imitation cannot tell the habit from the skill, the exact-match
  reward can;
* the prompt producer publishes prompts under admission control (bounded staleness);
* several rollout workers, each with its own bf16 copy of the policy, play groups of episodes and follow
  the trainer's weight versions as deltas, swapping them in between decode steps (double-buffered);
* a reward worker scores rollouts with the task's verifier;
* the trainer joins rollouts with rewards, trains GRPO steps and publishes a delta every step.

Every part is built by the builders of `rlbus.wiring` from the demo's run config (through
`rlbus.launch.arguments`, as ``rlbus worker`` builds each role), so the demo runs what a distributed run runs.
``rlbus demo --config run.toml`` runs a user's run config the same way (`DemoConfig.from_run`: the file's
task, model, trainer, rollout and reward; always the embedded bus, in-memory state and local blobs).

A live view shows reward, versions per worker, staleness, delta bytes and swap pauses; at the end the demo
evaluates the policy again, prints a summary, writes ``summary.json`` and ``demo.png`` into the run
directory, and (with ``--json``) the figures the README and docs/getting-started.md quote.

Accuracy is greedy exact-match on a fixed evaluation set drawn from the task generator with a seed the
training stream never uses; for single-digit addition the problem space is small (100 problems), so the
evaluation measures what the policy does on the task, not generalisation beyond it.

Why a sloppy teacher. With a clean teacher, this 0.6M-parameter policy's errors are idiosyncratic per
problem (it half-knows each of the 100 sums), and REINFORCE-style updates fix such errors one problem
at a time: 60 RL steps moved greedy accuracy only from 45 % to ≈ 55 % (bench/RESULTS.md, "demo settings
tried"). A systematic error is what RL on a small budget fixes visibly, and it is the common real case —
SFT data from a teacher with a consistent flaw. ``rlbus demo --teacher-error 0`` is the clean-teacher run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from rlbus.aio import until
from rlbus.bus.base import Bus
from rlbus.consumers.rollout import RolloutWorker, episode_threads
from rlbus.envs.evaluate import Scorer
from rlbus.envs.evaluate import evaluate as run_evaluation
from rlbus.launch.arguments import (
    evaluation_name,
    evaluation_prompts,
    initial_model,
    model_source,
    producer_args,
    reward_args,
    reward_function,
    rollout_args,
    trainer_args,
    warm_start_args,
)
from rlbus.launch.config import ModelSection, RunConfig, StateSection, TrainerSection
from rlbus.observe.runlog import STEPS, WEIGHTS, RunLog, syncs_name
from rlbus.observe.stats import percentile
from rlbus.producers.prompts import PromptProducer
from rlbus.schemas import Prompt
from rlbus.state.base import StateStore
from rlbus.training.join import JoinBuffer, Outcome
from rlbus.training.trainer import Trainer
from rlbus.training.warm import warm_start
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.sync import WeightSync
from rlbus.wiring.infra import open_bus, open_state, open_store
from rlbus.wiring.producer import prompt_producer
from rlbus.wiring.reward import reward_worker
from rlbus.wiring.rollout import RolloutStack, rollout_stack
from rlbus.wiring.trainer import trainer_stack

if TYPE_CHECKING:
    from rlbus.models.sources import Model, ModelSource

log = logging.getLogger("rlbus.demo")

#: The demo's run: the run config's defaults, in memory, with a sloppy teacher (so RL has a habit to
#: unlearn) and the trainer's join in arrival order.
#: The in-house policy (0.6 M parameters) stays on the CPU unless ``--device`` says otherwise: its matmuls are
#: too small for a GPU to gain anything, and its MoE routes on the host.
DEMO_RUN = RunConfig(state=StateSection(url="memory://"), trainer=TrainerSection(teacher_error=0.55, ordered=False),
                     model=ModelSection(device="cpu"))

#: The real-LLM run (``rlbus demo --model smollm2-135m-instruct``; ``infra/rlbus/smollm2.toml`` is the same run
#: for ``rlbus up``): SmolLM2-135M-Instruct on two-digit sums answered as ``<answer>N</answer>``, which it
#: never does on its own (0 % before the warm start). A short warm start from the sloppy teacher teaches the
#: format and the off-by-one habit; async GRPO with the exact-match verifier then fixes the habit.
SMOLLM2_TABLES: dict[str, dict[str, Any]] = {
    "model": {"kind": "hf", "name": "smollm2-135m-instruct", "device": "auto"},
    "task": {
        "env": "arith", "group_size": 8,
        "env_config": {"digits": 2, "instructions": True, "max_new_tokens": 24, "context_tokens": 128,
                       "max_total_tokens": 128},
    },
    "trainer": {"lr": 5e-6, "groups_per_step": 4, "warm_steps": 20, "warm_lr": 2e-5, "teacher_error": 0.55,
                "grpo": {"compute_dtype": "bfloat16"}},
    "rollout": {"max_batch": 64},
}


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: a run config (task, model, trainer, rollout, reward; ``DEMO_RUN`` by default,
    tuned to learn visibly on a 2-core CPU in a few minutes) and what only the demo has."""

    run: RunConfig = field(default_factory=lambda: DEMO_RUN)
    #: Rollout workers (each with its own engine and weight copy), and their regions.
    workers: int = 3
    regions: tuple[str, ...] = ("eu-west", "us-east", "ap-south")
    #: RL steps.
    rl_steps: int = 60
    #: Stop RL early after this many seconds (the figures then cover what ran).
    time_budget_s: float = 300.0
    #: Greedy evaluation problems (drawn with a seed the training stream never uses).
    eval_size: int = 100
    #: ``async``: everything runs continuously with bounded staleness. ``sync``: the baseline of
    #: ``rlbus bench pipeline`` — prompts are admitted one batch per version, rollout workers wait for
    #: that version before playing, the trainer only takes rollouts of its current version, so
    #: generation pauses while the trainer trains and the trainer waits for every batch.
    mode: Literal["async", "sync"] = "async"
    #: Keep a copy of the trainer's weights every this many steps (0: none), evaluated after the run.
    snapshot_every: int = 0

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(workers=2, rl_steps=15, time_budget_s=60.0).tuned(trainer={"warm_steps": 250})

    @classmethod
    def for_model(cls, model: str) -> DemoConfig:
        """The demo of a real model: `SMOLLM2_TABLES` for the shipped SmolLM2; any other HF model directory
        or GGUF file runs the same task and settings. On the GPU when there is one (``device = "auto"``)."""
        tables = {name: dict(fields) for name, fields in SMOLLM2_TABLES.items()}
        if model != "smollm2-135m-instruct":
            key = "gguf" if model.endswith(".gguf") else "path"
            tables["model"] = {"kind": "hf", key: model, "device": "auto"}
        return cls(workers=2, rl_steps=60, time_budget_s=1500.0, eval_size=100).tuned(**tables)

    @classmethod
    def from_run(cls, run: RunConfig) -> DemoConfig:
        """A user's run config (``rlbus demo --config``) on the embedded bus: ``[state]`` becomes ``memory://``;
        ``[bus]`` and ``[store]`` are not used (the bus is in memory, blobs go under the run directory). The
        demo's own settings (workers, steps, time budget, evaluation size) keep their defaults."""
        return cls(run=run.tuned(state={"url": "memory://"}))

    def tuned(self, **tables: dict[str, Any]) -> DemoConfig:
        """A copy whose run config has these fields changed, table by table
        (``tuned(task={"group_size": 4}, trainer={"warm_steps": 10})``): `RunConfig.tuned`."""
        return dataclasses.replace(self, run=self.run.tuned(**tables))

    @property
    def seed(self) -> int:
        return self.run.task.seed


@dataclass
class DemoResult:
    accuracy_start: float
    """Greedy held-out accuracy RL starts from (after the warm start)."""
    accuracy_end: float
    versions_published: int
    rollouts_trained: int
    rollouts_dropped: int
    max_staleness: int
    delta_bytes_mean: float
    full_bytes: int
    swap_pause_ms_p99: float
    wall_s: float
    steps: int
    rewards: list[tuple[float, float]] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)
    deltas: list[tuple[int, int]] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    accuracy_base: float | None = None
    """Greedy held-out accuracy of the model before the warm start; None when RL started from given weights."""
    steps_target: int = 0
    """The RL steps asked for; fewer in ``steps`` means the run ended on its time budget."""
    stalled: str | None = None
    """When the run ended on its time budget: what it was waiting for (`Demo.stall_report`)."""

    @property
    def completed(self) -> bool:
        """Whether the run did its steps (instead of ending on its time budget)."""
        return self.steps >= self.steps_target

    def figures(self) -> dict[str, Any]:
        keys = (
            "accuracy_base", "accuracy_start", "accuracy_end", "versions_published", "rollouts_trained",
            "rollouts_dropped", "max_staleness", "delta_bytes_mean", "full_bytes", "swap_pause_ms_p99", "wall_s",
            "steps", "steps_target", "completed", "stalled",
        )
        return {k: getattr(self, k) for k in keys} | {"outcomes": self.outcomes}


def demo_config(
    *, quick: bool = False, model: str | None = None, run: RunConfig | None = None, engine: str = "torch",
    steps: int | None = None, time_budget_s: float | None = None, workers: int | None = None, seed: int | None = None,
    teacher_error: float | None = None, device: str | None = None,
) -> DemoConfig:
    """The demo ``rlbus demo`` runs: a user's ``run`` config, a real ``model``, the quick or the full default,
    with the command line's overrides (None keeps the chosen config's own; ``device`` is ``[model] device``).
    vLLM runs one rollout worker by default (one vLLM per process on a small machine)."""
    if run is not None and (model is not None or quick):
        raise ValueError("--config runs the file's [model] and the demo's default steps: it does not combine with "
                         "--model or --quick (set [model] in the file, --steps for fewer steps)")
    config = DemoConfig.from_run(run) if run is not None else DemoConfig.for_model(model) if model else (
        DemoConfig.quick() if quick else DemoConfig())
    if engine != "torch":
        workers = 1 if workers is None else workers
        config = config.tuned(rollout={"engine": engine})
    config = dataclasses.replace(
        config,
        rl_steps=config.rl_steps if steps is None else steps,
        time_budget_s=config.time_budget_s if time_budget_s is None else time_budget_s,
        workers=config.workers if workers is None else workers,
    )
    return config.tuned(task={} if seed is None else {"seed": seed},
                        trainer={} if teacher_error is None else {"teacher_error": teacher_error},
                        model={} if device is None else {"device": device})


def headline(config: DemoConfig, run_dir: Path) -> str:
    """The demo's first line: what it trains on, with how many workers, where its files go."""
    task, trainer = config.run.task, config.run.trainer
    what = f"{task.env} {task.env_config}"
    if task.prompts is not None:
        what = f"prompts from {task.prompts} (evaluated on {evaluation_name(config.run)}"
        what += ")" if task.eval_prompts is not None else "; your own held-out file: [task] eval_prompts)"
    return (f"rlbus demo: {what}, {config.workers} rollout workers, G={task.group_size}, "
            f"{trainer.groups_per_step} groups/step, run dir {run_dir}")


def embedded_note(run: RunConfig, run_dir: Path) -> str:
    """The line ``rlbus demo --config`` prints: what of the file the embedded run does not use."""
    store = run.store.url or run.store.dir
    parts = [f"[bus] bootstrap {run.bus.bootstrap}", f"[state] url {run.state.url}"]
    parts.append(f"[store] {store}" if store else "[store]")
    note = (f"embedded: in-memory bus and state store, blobs under {run_dir / 'blobs'}; not used from the file: "
            f"{', '.join(parts)}")
    if run.dpo.train.steps:
        note += "; [dpo] (the demo runs no DPO stage: `rlbus train dpo --config`, then [model] checkpoint)"
    return note


def evaluate(model: Model, prompts: list[Prompt], source: ModelSource, scorer: Scorer | None = None) -> float:
    """Greedy held-out accuracy of the bf16 cast of ``model`` (what the workers serve), through the harness,
    scored by ``scorer`` (the run's reward function) or each prompt's environment."""
    return run_evaluation(model, prompts, source.chat, pad_id=source.pad_id, scorer=scorer).accuracy


class Demo:
    """Builds every role, runs them under one TaskGroup, and collects what the live view shows."""

    def __init__(self, config: DemoConfig, run_dir: Path, on_update: Callable[[Demo], None] | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.on_update = on_update
        self.source = model_source(config.run, progress=log.info)
        self.chat = self.source.chat
        #: The run's reward function scores the evaluations as it scores RL (None: each prompt's environment).
        self.scorer: Scorer | None = reward_function(config.run)
        self.started = time.monotonic()
        self.phase = "warm start"
        self.reward_points: list[tuple[float, float]] = []
        self.step_metrics: list[dict[str, Any]] = []
        self.accuracy_base: float | None = None
        self.accuracy_start: float | None = None
        self.accuracy_end: float | None = None
        self.syncs: list[WeightSync] = []
        self.rollout_workers: list[RolloutWorker] = []
        self.publisher: WeightPublisher | None = None
        self.trainer: Trainer | None = None
        self.join: JoinBuffer | None = None
        self.producer: PromptProducer | None = None
        self.stalled: str | None = None
        self.rl_started = 0.0
        self.rl_wall_s = 0.0
        #: (seconds since RL started, step, weights) every ``snapshot_every`` steps.
        self.snapshots: list[tuple[float, int, dict[str, torch.Tensor]]] = []
        #: The embedded bus and state store, set once RL starts (what `rlbus demo --dashboard` follows).
        self.bus: Bus | None = None
        self.state: StateStore | None = None

    def eval_prompts(self) -> list[Prompt]:
        return evaluation_prompts(self.config.run, self.config.eval_size)

    def warm_start(self, model: Model) -> None:
        """The run config's warm start (`rlbus.training.warm`): blocking."""
        warm_start(model, chat=self.chat, **warm_start_args(self.config.run))

    async def run(self, model: Model | None = None) -> DemoResult:
        """Warm start (unless ``model`` is given or ``[model] checkpoint`` names one: RL starts from it), async RL,
        evaluation."""
        c, run = self.config, self.config.run
        torch.manual_seed(c.seed)
        # One job at a time: the warm start and the evaluations of a real model use every core. The in-house
        # policy's matmuls are too small to gain from threads (and its warm start's bits would change).
        cores = (os.cpu_count() or 1) if self.source.threaded else 1
        torch.set_num_threads(cores)
        episode_threads(run.rollout.episode_threads)
        eval_prompts = self.eval_prompts()
        if model is None and run.model.checkpoint is not None:  # as the trainer role: no warm start on top
            model = await asyncio.to_thread(initial_model, run)
        if model is None:
            model = self.source.build(seed=c.seed)
            if run.trainer.warm_steps:
                self.accuracy_base = await asyncio.to_thread(evaluate, model, eval_prompts, self.source, self.scorer)
                self._update()
                await asyncio.to_thread(self.warm_start, model)
        self.accuracy_start = await asyncio.to_thread(evaluate, model, eval_prompts, self.source, self.scorer)
        self.phase = "async RL"
        self._update()
        torch.set_num_threads(1)  # many small matmuls from several roles on 2 cores: threads only contend

        # sync: nothing may lag (the trainer drops stale rollouts, the producer admits one batch per version)
        produce, train = producer_args(run), trainer_args(run)
        staleness = 0 if c.mode == "sync" else produce["max_staleness"]
        produce["max_staleness"] = staleness
        train["grpo"] = msgspec.structs.replace(train["grpo"], max_staleness=staleness)
        bus = open_bus(None, partitions=4)
        await bus.start()
        state = open_state(run.state.url)
        self.bus, self.state = bus, state
        store_url = str(self.run_dir / "blobs")
        store = open_store(store_url)
        trainer = trainer_stack(bus=bus, state=state, store=store, store_url=store_url, model=model, **train,
                                max_steps=c.rl_steps, on_step=self._on_step)
        self.trainer, self.publisher, self.join = trainer.trainer, trainer.publisher, trainer.join
        await self.trainer.publish()  # version 1: the warm-started weights, as a keyframe
        stacks: list[RolloutStack] = [
            rollout_stack(bus=bus, store=store, model=self.source, worker_id=f"rollout-{i}",
                          region=c.regions[i % len(c.regions)], seed=c.seed + 100 + i, on_policy=c.mode == "sync",
                          **rollout_args(run))
            for i in range(c.workers)
        ]
        self.syncs = [s.sync for s in stacks if s.sync is not None]
        self.rollout_workers = [s.worker for s in stacks]
        producer = self.producer = prompt_producer(
            bus=bus, state=state, **produce,
            run_id=f"demo-s{c.seed}",  # prompt ids, hence partitions, follow the seed: runs repeat
        )
        scorer = reward_worker(bus=bus, **reward_args(run))
        stop = asyncio.Event()
        rl_started = self.rl_started = time.monotonic()
        async with asyncio.TaskGroup() as tasks:
            for sync in self.syncs:
                tasks.create_task(sync.run(stop))
            await asyncio.gather(*(sync.ready.wait() for sync in self.syncs))
            tasks.create_task(trainer.worker.run(stop))
            tasks.create_task(scorer.run(stop))
            for worker in self.rollout_workers:
                tasks.create_task(worker.run(stop))
            for worker in self.rollout_workers:  # every worker in the group before the first prompt
                await worker.joined.wait()
            tasks.create_task(producer.run(stop))
            while not trainer.worker.finished and time.monotonic() - rl_started < c.time_budget_s:
                await asyncio.sleep(0.25)
                self._update()
            self.rl_wall_s = time.monotonic() - rl_started
            if trainer.worker.finished:  # let every worker swap the last version in (the figures include it)
                await self._workers_at(trainer.trainer.version, timeout_s=10.0)
            else:
                self.stalled = await self.stall_report()
                log.warning("RL ended on its %.0f s time budget: %s", c.time_budget_s, self.stalled)
            stop.set()
        self.phase = "evaluating"
        self._update()
        torch.set_num_threads(cores)
        self.accuracy_end = await asyncio.to_thread(evaluate, model, eval_prompts, self.source, self.scorer)
        self.phase = "done"
        self._update()
        result = await self._result()
        self._write_run_log(result)
        return result

    async def _workers_at(self, version: int, *, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every worker serves ``version``; a laggard is left behind."""
        with contextlib.suppress(TimeoutError):
            await until(lambda: all(s.version == version for s in self.syncs), f"every worker at v{version}",
                        timeout_s=timeout_s, every_s=0.05)

    async def stall_report(self) -> str:
        """What a run that ran out of time was waiting for: steps, versions, admission and outcomes."""
        assert self.trainer is not None and self.join is not None
        now = time.monotonic()
        since = now - self.started - self.reward_points[-1][0] if self.reward_points else now - self.rl_started
        workers = ", ".join(f"{w.region} v{s.version}" for w, s in zip(self.rollout_workers, self.syncs, strict=False))
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted((await self.join.counts()).items()) if v)
        parts = [f"{self.trainer.step} of {self.config.rl_steps} steps, the last {since:.0f} s ago",
                 f"trainer v{self.trainer.version}, workers {workers or 'none'}"]
        if self.producer is not None:
            p = self.producer.stats()
            parts.append(f"prompts admitted {p['admitted']} (waited {p['waits']} times for admission, "
                         f"{p['freed']} slots freed)")
        parts.append(f"rollouts {outcomes or 'none with an outcome'}")
        return "; ".join(parts)

    def _on_step(self, metrics: dict[str, Any]) -> None:
        self.step_metrics.append(metrics)
        self.reward_points.append((time.monotonic() - self.started, metrics["reward_mean"]))
        every = self.config.snapshot_every
        if every and self.trainer is not None and metrics["step"] % every == 0:
            weights = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
            self.snapshots.append((time.monotonic() - self.rl_started, metrics["step"], weights))

    def _write_run_log(self, result: DemoResult) -> None:
        """The run directory's event log (`rlbus.observe.runlog`), for `rlbus report`."""
        assert self.publisher is not None
        wall0 = time.time() - (time.monotonic() - self.started)  # monotonic → Unix time
        with RunLog(self.run_dir) as runlog:
            for (t, _), metrics in zip(self.reward_points, self.step_metrics, strict=True):
                runlog.write(STEPS, metrics, t=wall0 + t)
            for stats in self.publisher.history:
                runlog.write(WEIGHTS, stats)
            for worker, sync in zip(self.rollout_workers, self.syncs, strict=True):
                for swap in sync.history:
                    runlog.write(syncs_name(worker.worker_id), {"worker": worker.worker_id, **dataclasses.asdict(swap)})
            runlog.summary(result.figures())

    def _update(self) -> None:
        if self.on_update is not None:
            self.on_update(self)

    async def _result(self) -> DemoResult:
        assert self.publisher is not None and self.trainer is not None and self.join is not None
        outcomes = await self.join.counts()
        staleness: dict[int, int] = {}
        for m in self.step_metrics:
            for k, v in m.get("staleness", {}).items():
                staleness[int(k)] = staleness.get(int(k), 0) + int(v)
        pauses = [s.swap_pause_s * 1000 for sync in self.syncs for s in sync.history if s.kind == "delta"]
        deltas = [(h.version, h.delta_bytes) for h in self.publisher.history if h.delta_bytes]
        dropped = sum(v for k, v in outcomes.items() if k.startswith("dropped"))
        return DemoResult(
            accuracy_base=self.accuracy_base,
            accuracy_start=self.accuracy_start or 0.0,
            accuracy_end=self.accuracy_end or 0.0,
            versions_published=self.publisher.version,
            rollouts_trained=outcomes[Outcome.TRAINED],
            rollouts_dropped=dropped,
            max_staleness=max(staleness, default=0),
            delta_bytes_mean=sum(b for _, b in deltas) / max(1, len(deltas)),
            full_bytes=self.publisher.history[0].full_bytes,
            swap_pause_ms_p99=percentile(pauses, 99) if pauses else 0.0,
            wall_s=time.monotonic() - self.started,
            steps=self.trainer.step,
            steps_target=self.config.rl_steps,
            stalled=self.stalled,
            rewards=list(self.reward_points),
            staleness=staleness,
            deltas=deltas,
            outcomes=outcomes,
        )

