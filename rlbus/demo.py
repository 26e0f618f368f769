"""``rlbus demo``: the whole asynchronous RL loop in one process, on CPU, in a few minutes.

Every role runs as its own asyncio task on the embedded bus (:class:`rlbus.bus.memory.MemoryBus`), a
local-directory blob store and the in-memory state store — the same classes the distributed mode runs
against Kafka, Redis and the HTTP blob store:

* a small MoE policy is warm-started ("mid-training") on worked solutions of a built-in verifiable task
  from a *sloppy teacher*: on ``teacher_error`` of the examples (55 % by default) the teacher's answer
  is off by one. The warm-started policy learns the arithmetic and the teacher's habit with it, so its
  greedy answer is usually the habit (≈ 25 % right) while the right answer is among its samples — the
  situation RL with a verifier is for: imitation cannot tell the habit from the skill, the exact-match
  reward can;
* the prompt producer publishes prompts under admission control (bounded staleness);
* several rollout workers, each with its own bf16 copy of the policy, play groups of episodes and follow
  the trainer's weight versions as deltas, swapping them in between decode steps (double-buffered);
* a reward worker scores rollouts with the task's verifier;
* the trainer joins rollouts with rewards, trains GRPO steps and publishes a delta every step.

A live view shows reward, versions per worker, staleness, delta bytes and swap pauses; at the end the demo
evaluates the policy again, prints a summary, writes ``summary.json`` and ``demo.png`` into the run
directory, and (with ``--json``) the figures the README quotes.

Accuracy is greedy exact-match on a fixed evaluation set drawn from the task generator with a seed the
training stream never uses; for single-digit addition the problem space is small (100 problems), so the
evaluation measures what the policy does on the task, not generalisation beyond it.

Why a sloppy teacher. With a clean teacher, this 0.6M-parameter policy's errors are idiosyncratic per
problem (it half-knows each of the 100 sums), and REINFORCE-style updates fix such errors one problem
at a time: 60 RL steps moved greedy accuracy only from 45 % to ≈ 55 % (bench/RESULTS.md, "demo settings
tried"). A systematic error is what RL on a small budget fixes visibly, and it is the common real case —
SFT data from a teacher with a consistent flaw. Set ``teacher_error = 0`` for the clean-teacher run.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from msgspec.structs import replace

from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.consumers.reward import RewardWorker
from rlbus.consumers.rollout import RolloutWorker, episode_threads
from rlbus.consumers.trainer import Trainer, TrainerWorker
from rlbus.engines.base import GenerationRequest
from rlbus.engines.batching import BatchingEngine
from rlbus.engines.torch_engine import TorchEngine
from rlbus.envs.agent import reference_episode
from rlbus.envs.base import Task, env_for
from rlbus.envs.chat import ChatFormat, parse_action
from rlbus.envs.tasks import generate_prompts
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.observe.runlog import STEPS, WEIGHTS, RunLog, syncs_name
from rlbus.observe.stats import percentile
from rlbus.producers.prompts import Admission, PromptProducer, progress_from_state, task_prompts
from rlbus.schemas import Prompt, SamplingInfo
from rlbus.state.join import JoinBuffer, Outcome, RewardPolicy
from rlbus.state.memory import MemoryStateStore
from rlbus.training.sft import SFTExample, pretrain
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.weights.publish import WeightPublisher
from rlbus.weights.store import LocalStore
from rlbus.weights.sync import WeightSync, bind_module, live_state

log = logging.getLogger("rlbus.demo")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs; the defaults are tuned to learn visibly on a 2-core CPU in a few minutes."""

    #: Built-in task and its configuration.
    env: str = "arith"
    env_config: dict[str, Any] = field(default_factory=lambda: {"digits": 1})
    #: Rollout workers (each with its own engine and weight copy), and their regions.
    workers: int = 3
    regions: tuple[str, ...] = ("eu-west", "us-east", "ap-south")
    #: GRPO group size and groups per trainer step.
    group_size: int = 8
    groups_per_step: int = 8
    #: Versions a rollout may lag the trainer; also the admission-control bound.
    max_staleness: int = 2
    #: Fraction of warm-start examples whose answer the teacher gets wrong by +1 (numeric answers only).
    teacher_error: float = 0.55
    #: Supervised warm-start steps and RL steps.
    warm_steps: int = 400
    rl_steps: int = 60
    #: Stop RL early after this many seconds (the figures then cover what ran).
    time_budget_s: float = 300.0
    #: RL learning rate. Higher rates (1e-3) collapse this tiny policy within a few steps: Adam's first
    #: updates are ≈ lr·sign(g) on every weight, noise that undoes the warm start.
    lr: float = 3e-4
    warm_lr: float = 3e-3
    #: Sampling temperature of the rollout workers (the trainer scores at the same temperature).
    temperature: float = 1.0
    seed: int = 0
    eval_size: int = 100
    #: ``async``: everything runs continuously with bounded staleness. ``sync``: the baseline of
    #: ``rlbus bench pipeline`` — prompts are admitted one batch per version, rollout workers wait for
    #: that version before playing, the trainer only takes rollouts of its current version, so
    #: generation pauses while the trainer trains and the trainer waits for every batch.
    mode: Literal["async", "sync"] = "async"
    #: Keep a copy of the trainer's weights every this many steps (0: none), evaluated after the run.
    snapshot_every: int = 0
    model: PolicyConfig = field(
        default_factory=lambda: PolicyConfig(
            vocab=272, d_model=96, n_layer=3, n_head=4, max_seq=64, n_experts=4, top_k=2, d_ff=128
        )
    )

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(workers=2, warm_steps=250, rl_steps=15, time_budget_s=60.0)


@dataclass
class DemoResult:
    accuracy_start: float
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

    def figures(self) -> dict[str, Any]:
        keys = (
            "accuracy_start", "accuracy_end", "versions_published", "rollouts_trained", "rollouts_dropped",
            "max_staleness", "delta_bytes_mean", "full_bytes", "swap_pause_ms_p99", "wall_s", "steps",
        )
        return {k: getattr(self, k) for k in keys} | {"outcomes": self.outcomes}


def sft_examples(task: Task[Any], prompts: list[Prompt], chat: ChatFormat) -> list[SFTExample]:
    """Reference solutions played through the real harness: prompt tokens → the model's tokens."""

    async def one(prompt: Prompt) -> SFTExample:
        episode = await reference_episode(task, prompt, chat=chat)
        first = episode.loss_mask.index(1)
        return SFTExample(tuple(episode.token_ids[:first]), tuple(episode.token_ids[first:]))

    async def all_examples() -> list[SFTExample]:
        return [await one(p) for p in prompts]

    return asyncio.run(all_examples())


def sloppy_teacher(prompts: list[Prompt], error: float, *, seed: int) -> list[Prompt]:
    """The warm-start references of a teacher that answers ``n + 1`` instead of ``n`` on a fraction
    ``error`` of the examples (seeded). Non-numeric references are left as they are."""
    rng = random.Random(seed)
    out = []
    for prompt in prompts:
        reference = prompt.reference or ""
        if reference.lstrip("-").isdigit() and rng.random() < error:
            prompt = replace(prompt, reference=str(int(reference) + 1))
        out.append(prompt)
    return out


def evaluate(model: Policy, prompts: list[Prompt], chat: ChatFormat) -> float:
    """Greedy exact-match accuracy of the bf16 cast of ``model`` (what the workers serve)."""
    engine = TorchEngine(copy.deepcopy(model).to(torch.bfloat16).eval(), tokenizer=chat.tokenizer)
    requests = [
        GenerationRequest(
            prompt_ids=(*chat.bos, *chat.header("user"), *chat.encode(p.text), *chat.header("assistant")),
            max_new_tokens=24, temperature=0.0, stop_token_ids=(chat.eos_id,),
        )
        for p in prompts
    ]
    results = engine.generate(requests)
    correct = 0
    for prompt, result in zip(prompts, results, strict=True):
        action = parse_action(result.text)
        answer = getattr(action, "text", None)
        correct += int(answer is not None and answer.strip() == (prompt.reference or "").strip())
    return correct / len(prompts)


class Demo:
    """Builds every role, runs them under one TaskGroup, and collects what the live view shows."""

    def __init__(self, config: DemoConfig, run_dir: Path, on_update: Callable[[Demo], None] | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.on_update = on_update
        self.tokenizer = ByteTokenizer()
        self.chat = ChatFormat.for_byte_tokenizer(self.tokenizer)
        self.started = time.monotonic()
        self.phase = "warm start"
        self.reward_points: list[tuple[float, float]] = []
        self.step_metrics: list[dict[str, Any]] = []
        self.accuracy_start: float | None = None
        self.accuracy_end: float | None = None
        self.syncs: list[WeightSync] = []
        self.rollout_workers: list[RolloutWorker] = []
        self.publisher: WeightPublisher | None = None
        self.trainer: Trainer | None = None
        self.join: JoinBuffer | None = None
        self.rl_started = 0.0
        self.rl_wall_s = 0.0
        #: (seconds since RL started, step, weights) every ``snapshot_every`` steps.
        self.snapshots: list[tuple[float, int, dict[str, torch.Tensor]]] = []
        #: The embedded bus and state store, set once RL starts (what `rlbus demo --dashboard` follows).
        self.bus: MemoryBus | None = None
        self.state: MemoryStateStore | None = None

    def eval_prompts(self) -> list[Prompt]:
        c = self.config
        return generate_prompts(c.env, seed=10_000 + c.seed, n=c.eval_size, config=c.env_config)

    def warm_start(self, model: Policy) -> None:
        task: Any = env_for(generate_prompts(self.config.env, seed=0, n=1, config=self.config.env_config)[0])
        train = generate_prompts(self.config.env, seed=self.config.seed + 1, n=400, config=self.config.env_config)
        train = sloppy_teacher(train, self.config.teacher_error, seed=self.config.seed)
        examples = sft_examples(task, train, self.chat)
        pretrain(model, examples, steps=self.config.warm_steps, lr=self.config.warm_lr, batch_size=32,
                 seed=self.config.seed)

    async def run(self, model: Policy | None = None) -> DemoResult:
        """Warm start (unless ``model`` is given: RL starts from it), async RL, evaluation."""
        c = self.config
        torch.manual_seed(c.seed)
        torch.set_num_threads(1)  # many small matmuls from several roles on 2 cores: threads only contend
        episode_threads(64)
        eval_prompts = self.eval_prompts()
        if model is None:
            model = Policy(c.model)
            await asyncio.to_thread(self.warm_start, model)
        self.accuracy_start = await asyncio.to_thread(evaluate, model, eval_prompts, self.chat)
        self.phase = "async RL"
        self._update()

        staleness = 0 if c.mode == "sync" else c.max_staleness
        bus = MemoryBus(topic_specs(partitions=4))
        await bus.start()
        state = MemoryStateStore()
        self.bus, self.state = bus, state
        store = LocalStore(self.run_dir / "blobs")
        self.publisher = WeightPublisher(bus=bus, store=store, keyframe_every=20, retain_versions=5)
        self.trainer = Trainer(
            model=model, optim=OptimConfig(lr=c.lr), grpo=GRPOConfig(max_staleness=staleness, normalize_std=True),
            publisher=self.publisher,
        )
        await self.trainer.publish()  # version 1: the warm-started weights, as a keyframe
        self.join = JoinBuffer(state=state, policy=RewardPolicy(sources=("verifier",), timeout_s=60))
        trainer_worker = TrainerWorker(
            bus=bus, trainer=self.trainer, join=self.join, state=state, groups_per_step=c.groups_per_step,
            max_steps=c.rl_steps, on_step=self._on_step,
        )
        engines = []
        for i in range(c.workers):
            weights = Policy(c.model).to(torch.bfloat16).eval()
            inner = TorchEngine(weights, tokenizer=self.tokenizer, seed=c.seed + 100 + i, policy_version=0)
            engine = BatchingEngine(inner, max_batch=64, window_s=0.003)
            engines.append(engine)
            self.syncs.append(
                WeightSync(
                    bus=bus, store=store, state=live_state(weights), bind=bind_module(weights),
                    swap=inner.swap_point.apply, on_swap=_version_setter(inner),
                )
            )
            self.rollout_workers.append(
                RolloutWorker(
                    bus=bus, engine=engine, chat=self.chat, worker_id=f"rollout-{i}",
                    region=c.regions[i % len(c.regions)], sampling=SamplingInfo(temperature=c.temperature),
                    prompts_in_flight=2, on_policy=c.mode == "sync",
                )
            )
        producer = PromptProducer(
            bus=bus,
            prompts=task_prompts(c.env, seed=c.seed + 1000, group_size=c.group_size, config=c.env_config),
            admission=Admission(max_staleness=staleness, groups_per_step=c.groups_per_step),
            progress=progress_from_state(state),
            run_id=f"demo-s{c.seed}",  # prompt ids, hence partitions, follow the seed: runs repeat
        )
        reward_worker = RewardWorker(bus=bus, concurrency=8)
        stop = asyncio.Event()
        rl_started = self.rl_started = time.monotonic()
        async with asyncio.TaskGroup() as tasks:
            for sync in self.syncs:
                tasks.create_task(sync.run(stop))
            while any(s.version is None for s in self.syncs):  # noqa: ASYNC110 - versions are plain ints
                await asyncio.sleep(0.05)
            tasks.create_task(trainer_worker.run(stop))
            tasks.create_task(reward_worker.run(stop))
            for worker in self.rollout_workers:
                tasks.create_task(worker.run(stop))
            for worker in self.rollout_workers:  # every worker in the group before the first prompt
                await worker.joined.wait()
            tasks.create_task(producer.run(stop))
            while not trainer_worker.finished and time.monotonic() - rl_started < c.time_budget_s:
                await asyncio.sleep(0.25)
                self._update()
            self.rl_wall_s = time.monotonic() - rl_started
            stop.set()
        self.phase = "evaluating"
        self._update()
        self.accuracy_end = await asyncio.to_thread(evaluate, model, eval_prompts, self.chat)
        self.phase = "done"
        self._update()
        result = await self._result(bus)
        self._write_run_log(result)
        return result

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

    async def _result(self, bus: MemoryBus) -> DemoResult:
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
            rewards=list(self.reward_points),
            staleness=staleness,
            deltas=deltas,
            outcomes=outcomes,
        )


def _version_setter(engine: TorchEngine) -> Callable[[int], None]:
    def set_version(version: int) -> None:
        engine.policy_version = version

    return set_version
