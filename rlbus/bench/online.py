"""``rlbus bench online``: learning from served traffic — simulated users rate served answers with noisy
thumbs, the trainer learns online, held-out accuracy rises; against the same run with random thumbs.

The demo's task and policy (`rlbus.demo`: single-digit sums, the 0.6M-parameter MoE warm-started from the
sloppy teacher, so its greedy answer is usually off by one). Then, per arm, from the same warm-started
weights and the same question stream:

* the trainer (`rlbus.build.trainer.trainer_stack`, the run config's ``[trainer.online]`` enabled) on the
  embedded bus publishes versions; one serving engine (the rollout fleet's torch engine, following the
  trainer's versions through delta sync) answers users;
* ``concurrency`` simulated users each ask a question, get the served answer (sampled at temperature 1, as
  production would), and a fraction ``rate`` of them rate it after a random delay through the feedback
  API (`rlbus.producers.feedback`, over HTTP): thumbs up with probability ``up_if_right`` when the answer
  is right, ``up_if_wrong`` when it is wrong — or, in the baseline arm, up with probability 0.5 whatever
  the answer (random thumbs: the same traffic and updates, no signal);
* the served rollouts (one `Rollout` each, group_size 1, ``metadata.origin = "served"``) wait in the
  trainer's served join for their thumbs, which release them; a version is published every
  ``release_every_rewards`` rewards or ``release_every_s`` seconds.

Reported: greedy held-out accuracy (`rlbus.envs.evaluate`, the demo's 100 held-out problems) before and
after each arm, the served answers' accuracy in the first and last fifth of the traffic, versions,
samples trained and dropped. How answers are served is one function, `serve`, which records the gateway's
contract (the Rollout a served completion becomes); ``path`` in the JSON names the serving path used.
"""

from __future__ import annotations

import asyncio
import copy
import random
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from rlbus.bench.common import meta, print_table, write_json
from rlbus.build.infra import open_bus, open_state, open_store
from rlbus.build.rollout import RolloutStack, rollout_stack
from rlbus.build.trainer import trainer_stack
from rlbus.bus.base import Bus
from rlbus.bus.topics import ROLLOUTS
from rlbus.consumers.rollout import episode_threads
from rlbus.demo import DemoConfig
from rlbus.envs.base import env_for
from rlbus.envs.episode import rollout_to_episode
from rlbus.envs.evaluate import evaluate, held_out_prompts
from rlbus.envs.tasks import generate_prompts
from rlbus.launch.build import model_source, rollout_args, trainer_args, warm_start_args
from rlbus.producers.feedback import Feedback, FeedbackServer, send_feedback
from rlbus.schemas import Prompt, Rollout
from rlbus.training.warm import warm_start

if TYPE_CHECKING:
    from rlbus.build.model import Model

#: How the recorded figure's answers were served (the gateway's path replaces `serve` once it is on main).
PATH = "direct-engine"
TOKEN = "bench-online-feedback-token"


@dataclass(frozen=True)
class Users:
    """The simulated users of one arm."""

    #: Fraction of answers rated at all.
    rate: float = 0.6
    #: P(thumbs up | right answer) and P(thumbs up | wrong answer); ``informative = False``: 0.5 for both.
    up_if_right: float = 0.85
    up_if_wrong: float = 0.15
    informative: bool = True
    #: A rating comes this many seconds after the answer (uniform).
    delay_s: tuple[float, float] = (0.0, 2.0)

    def p_up(self, right: bool) -> float:
        if not self.informative:
            return 0.5
        return self.up_if_right if right else self.up_if_wrong


@dataclass(frozen=True)
class Settings:
    requests: int = 4000
    concurrency: int = 32
    release_every_rewards: int = 48
    release_every_s: float = 10.0
    estimator: str = "ema"
    lr: float = 3e-4
    warm_steps: int = 400
    eval_size: int = 100
    seed: int = 0


QUICK = Settings(requests=600, concurrency=16, release_every_rewards=24, warm_steps=250, eval_size=50)


def served_rollout(rollout: Rollout, *, completion_id: str, task: str, tenant: str) -> Rollout:
    """The gateway's recording contract: one served completion is one `Rollout` of group_size 1 under the
    completion id, prompt id = the task key, ``metadata.origin = "served"``."""
    return msgspec.structs.replace(
        rollout, rollout_id=completion_id, prompt_id=task, group_index=0, group_size=1,
        metadata={**rollout.metadata, "origin": "served", "tenant": tenant, "session_id": completion_id,
                  "task": task},
    )


async def serve(stack: RolloutStack, bus: Bus, prompt: Prompt, *, tenant: str = "bench") -> Rollout:
    """Answer one user question and record it on ``rl.rollouts.v1`` as the gateway does: the one place the
    bench serves (switching to the gateway changes only this function). Direct path: one episode on the
    rollout fleet's engine (`RolloutWorker.play`), sampled at the fleet's temperature."""
    single = msgspec.structs.replace(prompt, group_size=1)
    (rollout,) = await stack.worker.play(single)
    recorded = served_rollout(rollout, completion_id=f"cmpl-{uuid.uuid4().hex[:16]}", task=prompt.env, tenant=tenant)
    await bus.send(ROLLOUTS, recorded)
    return recorded


async def is_right(rollout: Rollout) -> bool:
    """What the simulated user knows: whether the served answer is right (the task's verifier)."""
    assert rollout.prompt is not None
    reward = await env_for(rollout.prompt).score(rollout_to_episode(rollout), rollout.prompt)
    return reward.value >= 1.0


async def run_arm(
    name: str, warm: Model, users: Users, settings: Settings, demo: DemoConfig, questions: list[Prompt],
    evaluation: list[Prompt], workdir: Path,
) -> dict[str, Any]:
    """One arm from the warm-started weights: serve ``questions``, learn from the thumbs, evaluate."""
    source = model_source(demo.run)
    model = copy.deepcopy(warm)
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    bus = open_bus(None, partitions=4)
    await bus.start()
    state = open_state("memory://")
    store_url = str(workdir / name / "blobs")
    store = open_store(store_url)
    stack = trainer_stack(bus=bus, state=state, store=store, store_url=store_url, model=model,
                          **trainer_args(demo.run))
    await stack.trainer.publish()  # v1: the warm-started weights, a keyframe the serving engine starts from
    serving = rollout_stack(bus=bus, store=store, model=source, worker_id="serve-0", seed=settings.seed + 7,
                            **rollout_args(demo.run))
    assert serving.sync is not None
    feedback = FeedbackServer(bus=bus, token=TOKEN)
    lane = stack.worker.online
    assert lane is not None
    served: list[tuple[int, bool]] = []  # (request index, right)
    rated = 0
    stop = asyncio.Event()
    started = time.monotonic()

    async def rate(rollout: Rollout, right: bool) -> None:
        nonlocal rated
        await asyncio.sleep(rng.uniform(*users.delay_s))
        up = rng.random() < users.p_up(right)
        assert feedback.address is not None
        url = f"http://{feedback.address[0]}:{feedback.address[1]}"
        await send_feedback(url, TOKEN, Feedback(rollout_id=rollout.rollout_id, signal="up" if up else "down",
                                                 prompt_id=rollout.prompt_id, user=f"u{rng.randrange(10**6)}"))
        rated += 1

    async def user(queue: asyncio.Queue[tuple[int, Prompt]], ratings: asyncio.TaskGroup) -> None:
        while not queue.empty():
            index, prompt = queue.get_nowait()
            rollout = await serve(serving, bus, prompt)
            right = await is_right(rollout)
            served.append((index, right))
            if rng.random() < users.rate:
                ratings.create_task(rate(rollout, right))
            if len(served) % 500 == 0:
                print(f"  [{name}] {len(served)}/{len(questions)} served, v{stack.trainer.version}, "
                      f"{lane.totals['samples']} trained", flush=True)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(serving.sync.run(stop))
        await serving.sync.ready.wait()
        tasks.create_task(stack.worker.run(stop))
        tasks.create_task(feedback.run(stop, port=0))
        await feedback.listening.wait()
        queue: asyncio.Queue[tuple[int, Prompt]] = asyncio.Queue()
        for item in enumerate(questions):
            queue.put_nowait(item)
        async with asyncio.TaskGroup() as ratings:
            for _ in range(settings.concurrency):
                ratings.create_task(user(queue, ratings))
        # every rating is on the bus: wait until the trainer has released what the thumbs joined
        for _ in range(600):  # at most 2 minutes
            settled = lane.totals["samples"] + lane.totals["dropped_age"] + lane.totals["dropped_stale"]
            if not lane.ready and settled >= rated:
                break
            await asyncio.sleep(0.2)
        wall = time.monotonic() - started
        stop.set()
    await bus.close()
    accuracy = await asyncio.to_thread(lambda: evaluate(model, evaluation, source.chat, pad_id=source.pad_id).accuracy)
    fifth = max(1, len(served) // 5)
    ordered = [right for _, right in sorted(served)]
    baselines = [m["online_baseline"] for m in stack.worker.steps if "online_baseline" in m]
    staleness: dict[int, int] = {}
    for m in stack.worker.steps:
        for behind, n in m["staleness"].items():
            staleness[int(behind)] = staleness.get(int(behind), 0) + n
    return {
        "arm": name, "users": asdict(users), "accuracy_end": accuracy,
        "served_accuracy_first_fifth": sum(ordered[:fifth]) / fifth,
        "served_accuracy_last_fifth": sum(ordered[-fifth:]) / fifth,
        "requests": len(served), "rated": rated, "versions": stack.trainer.version - 1,
        "samples_trained": lane.totals["samples"], "dropped_age": lane.totals["dropped_age"],
        "dropped_stale": lane.totals["dropped_stale"], "releases": lane.totals["releases"],
        "baseline_last": baselines[-1] if baselines else None, "wall_s": wall,
        "staleness": dict(sorted(staleness.items())), "serving_version": serving.engine.policy_version,
        "trainer_version": stack.trainer.version,
        "steps": [{k: m.get(k) for k in ("version", "online_samples", "reward_mean", "online_baseline", "kl_k3",
                                         "is_ess", "grad_norm")} for m in stack.worker.steps],
    }


async def _run(settings: Settings, arms: list[tuple[str, Users, str]]) -> dict[str, Any]:
    demo = DemoConfig()
    tables: dict[str, Any] = {"lr": settings.lr, "warm_steps": settings.warm_steps,
                              "online": {"enabled": True, "estimator": settings.estimator, "baseline": "task",
                                         "release_every_rewards": settings.release_every_rewards,
                                         "release_every_s": settings.release_every_s, "max_age_s": 3600.0,
                                         "max_staleness": 16, "min_count": 0}}
    demo = demo.tuned(trainer=tables)
    source = model_source(demo.run)
    task = demo.run.task
    torch.set_num_threads(1)
    episode_threads(demo.run.rollout.episode_threads)
    torch.manual_seed(settings.seed)
    warm = source.build(seed=settings.seed)
    print("warm start (the demo's sloppy teacher) …", flush=True)
    await asyncio.to_thread(warm_start, warm, chat=source.chat, **warm_start_args(demo.run))
    evaluation = held_out_prompts(task.env, task.env_config, seed=task.seed, n=settings.eval_size)
    before = await asyncio.to_thread(lambda: evaluate(warm, evaluation, source.chat, pad_id=source.pad_id).accuracy)
    print(f"held-out accuracy after the warm start: {before:.0%}", flush=True)
    questions = generate_prompts(task.env, seed=20_000 + task.seed, n=settings.requests, config=task.env_config)
    results = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-online-") as tmp:
        for name, users, estimator in arms:
            arm_demo = demo.tuned(trainer={"online": {**tables["online"], "estimator": estimator}})
            print(f"arm {name}: {settings.requests} requests, {users.rate:.0%} rated …", flush=True)
            result = await run_arm(name, warm, users, settings, arm_demo, questions, evaluation, Path(tmp))
            results.append({"estimator": estimator, "accuracy_start": before, **result})
    return {"path": PATH, "settings": asdict(settings), "accuracy_start": before, "arms": results}


def run(quick: bool = False, json_path: Path | None = None) -> dict[str, Any]:
    settings = QUICK if quick else Settings()
    arms = [("noisy thumbs, ema", Users(), "ema")]
    if not quick:
        arms.append(("noisy thumbs, loo", Users(), "loo"))
    arms.append(("random thumbs (baseline)", replace(Users(), informative=False), "ema"))
    started = time.monotonic()
    result = asyncio.run(_run(settings, arms))
    result["wall_s"] = time.monotonic() - started
    result["meta"] = meta()
    print_table(
        f"online learning from served traffic ({PATH}; {settings.requests} requests per arm)",
        ["arm", "held-out before", "held-out after", "served first 1/5", "served last 1/5", "rated", "trained",
         "versions", "wall s"],
        [[a["arm"], f"{a['accuracy_start']:.0%}", f"{a['accuracy_end']:.0%}",
          f"{a['served_accuracy_first_fifth']:.0%}", f"{a['served_accuracy_last_fifth']:.0%}", a["rated"],
          a["samples_trained"], a["versions"], a["wall_s"]] for a in result["arms"]],
    )
    write_json(json_path, result)
    return result
