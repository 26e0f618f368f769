"""``rlbus bench online``: learning from served traffic — simulated users rate served answers with noisy
thumbs, the trainer learns online, held-out accuracy rises; against the same run with random thumbs.

The demo's task and policy (`rlbus.demo`: single-digit sums, the 0.6M-parameter MoE warm-started from the
sloppy teacher, so its greedy answer is usually off by one). Then, per arm, from the same warm-started
weights and the same question stream:

* the trainer (`rlbus.wiring.trainer.trainer_stack`, the run config's ``[trainer.online]`` enabled) on the
  embedded bus publishes versions; the OpenAI-compatible gateway (`rlbus.serve`, on the rollout fleet's
  torch engine, following the trainer's versions through delta sync) answers users and records each
  completion as a rollout (``X-RL-Record-Rollout``);
* ``concurrency`` simulated users each ask a question with the official ``openai`` client, get the served
  answer (sampled at temperature 1, as production would), and a fraction ``rate`` of them rate its
  completion id after a random delay through the feedback
  API (`rlbus.producers.feedback`, over HTTP): thumbs up with probability ``up_if_right`` when the answer
  is right, ``up_if_wrong`` when it is wrong — or, in the baseline arm, up with probability 0.5 whatever
  the answer (random thumbs: the same traffic and updates, no signal);
* the served rollouts (one `Rollout` each, group_size 1, ``metadata.origin = "served"``) wait in the
  trainer's served join for their thumbs, which release them; a version is published every
  ``release_every_rewards`` rewards or ``release_every_s`` seconds.

Reported: greedy held-out accuracy (`rlbus.envs.evaluate`, the demo's 100 held-out problems) before and
after each arm, the served answers' accuracy in the first and last fifth of the traffic, versions,
samples trained and dropped. How answers are served is one function, `serve` (the gateway through the
``openai`` client); `serve_direct` is the engine path without HTTP that produces the same Rollout contract
(the integration tests use both). ``path`` in the JSON names the serving path the figures used.
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

from rlbus.bus.base import Bus
from rlbus.bus.topics import ROLLOUTS
from rlbus.consumers.rollout import episode_threads
from rlbus.demo import DemoConfig
from rlbus.envs.actions import Answer
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.evaluate import evaluate, held_out_prompts
from rlbus.envs.scoring import normalize_answer
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import ConfigError
from rlbus.launch.arguments import model_source, trainer_args, warm_start_args
from rlbus.producers.feedback import Feedback, FeedbackServer, send_feedback
from rlbus.schemas import Prompt, Rollout
from rlbus.serve.auth import Tenants
from rlbus.serve.stack import run_serve, serve_stack
from rlbus.training.warm import warm_start
from rlbus.wiring.infra import open_bus, open_state, open_store
from rlbus.wiring.rollout import RolloutStack
from rlbus.wiring.trainer import trainer_stack
from rlbus_tools.bench.common import JsonPath, Quick, meta, print_table, write_json

if TYPE_CHECKING:
    from rlbus.models.sources import Model

#: How the recorded figure's answers were served.
PATH = "gateway"
TOKEN = "bench-online-feedback-token"
TENANT = "bench"


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


@dataclass(frozen=True)
class Served:
    """One served answer as the user sees it: the completion id feedback names, its task key, the text."""

    completion_id: str
    prompt_id: str
    text: str


async def serve(client: Any, model: str, prompt: Prompt, *, max_tokens: int) -> Served:
    """Ask the gateway (``client``: an ``openai.AsyncOpenAI`` at ``rlbus serve``) one question, recorded as a
    rollout: the one place the bench serves."""
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt.text}], temperature=1.0, max_tokens=max_tokens,
        metadata={"task": prompt.env}, extra_headers={"X-RL-Record-Rollout": "1"},
    )
    completion = raw.parse()
    return Served(raw.headers["X-RL-Rollout-Id"], raw.headers["X-RL-Prompt-Id"],
                  completion.choices[0].message.content or "")


def served_rollout(rollout: Rollout, *, completion_id: str, task: str, tenant: str) -> Rollout:
    """The gateway's recording contract: one served completion is one `Rollout` of group_size 1 under the
    completion id, prompt id = the task key, ``metadata.origin = "served"``."""
    return msgspec.structs.replace(
        rollout, rollout_id=completion_id, prompt_id=task, group_index=0, group_size=1,
        metadata={**rollout.metadata, "origin": "served", "tenant": tenant, "session_id": completion_id,
                  "task": task},
    )


async def serve_direct(stack: RolloutStack, bus: Bus, prompt: Prompt, *, tenant: str = TENANT) -> Rollout:
    """The engine path without HTTP: one episode on the rollout fleet's engine (`RolloutWorker.play`),
    recorded on ``rl.rollouts.v1`` under the gateway's contract (`served_rollout`)."""
    single = msgspec.structs.replace(prompt, group_size=1)
    (rollout,) = await stack.worker.play(single)
    recorded = served_rollout(rollout, completion_id=f"cmpl-{uuid.uuid4().hex[:16]}", task=prompt.env, tenant=tenant)
    await bus.send(ROLLOUTS, recorded)
    return recorded


def is_right(chat: ChatFormat, prompt: Prompt, text: str) -> bool:
    """What the simulated user knows: whether the answer in ``text`` is the right one (the task's exact match)."""
    action = chat.parse(text)
    return isinstance(action, Answer) and prompt.reference is not None and (
        normalize_answer(action.text) == normalize_answer(prompt.reference))


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
    gateway = serve_stack(bus=bus, source=source, tenants=Tenants({TENANT: TOKEN}), store=store,
                          seed=settings.seed + 7, max_batch=64)
    max_tokens = env_for(questions[0]).limits().max_new_tokens
    feedback = FeedbackServer(bus=bus, token=TOKEN)
    lane = stack.worker.online
    assert lane is not None
    served: list[tuple[int, bool]] = []  # (request index, right)
    rated = 0
    stop = asyncio.Event()
    started = time.monotonic()

    async def rate(answer: Served, right: bool) -> None:
        nonlocal rated
        await asyncio.sleep(rng.uniform(*users.delay_s))
        up = rng.random() < users.p_up(right)
        assert feedback.address is not None
        url = f"http://{feedback.address[0]}:{feedback.address[1]}"
        await send_feedback(url, TOKEN, Feedback(rollout_id=answer.completion_id, signal="up" if up else "down",
                                                 prompt_id=answer.prompt_id, user=f"u{rng.randrange(10**6)}"))
        rated += 1

    async def user(client: Any, queue: asyncio.Queue[tuple[int, Prompt]], ratings: asyncio.TaskGroup) -> None:
        while not queue.empty():
            index, prompt = queue.get_nowait()
            answer = await serve(client, gateway.gateway.model_name, prompt, max_tokens=max_tokens)
            right = is_right(source.chat, prompt, answer.text)
            served.append((index, right))
            if rng.random() < users.rate:
                ratings.create_task(rate(answer, right))
            if len(served) % 500 == 0:
                print(f"  [{name}] {len(served)}/{len(questions)} served, v{stack.trainer.version}, "
                      f"{lane.totals['samples']} trained", flush=True)

    openai = _openai()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(run_serve(gateway, stop, host="127.0.0.1", port=0))
        tasks.create_task(stack.worker.run(stop))
        tasks.create_task(feedback.run(stop, port=0))
        await feedback.listening.wait()
        await gateway.gateway.listening.wait()
        assert gateway.rollout.sync is not None
        await gateway.rollout.sync.ready.wait()
        host, port = gateway.gateway.address or ("127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=TOKEN, max_retries=0,
                                    timeout=120.0)
        queue: asyncio.Queue[tuple[int, Prompt]] = asyncio.Queue()
        for item in enumerate(questions):
            queue.put_nowait(item)
        async with asyncio.TaskGroup() as ratings:
            for _ in range(settings.concurrency):
                ratings.create_task(user(client, queue, ratings))
        # every rating is on the bus: wait until the trainer has released what the thumbs joined
        for _ in range(600):  # at most 2 minutes
            settled = lane.totals["samples"] + lane.totals["dropped_age"] + lane.totals["dropped_stale"]
            if not lane.ready and settled >= rated:
                break
            await asyncio.sleep(0.2)
        wall = time.monotonic() - started
        await client.close()
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
        "staleness": dict(sorted(staleness.items())),
        "trainer_version": stack.trainer.version, "serving_version": gateway.rollout.engine.policy_version,
        "steps": [{k: m.get(k) for k in ("version", "online_samples", "tokens", "reward_mean", "online_baseline",
                                         "kl_k3", "is_ess", "grad_norm")} for m in stack.worker.steps],
    }


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ConfigError("bench.online", "needs the official openai client: pip install 'rlbus[bench]'") from None
    return openai


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


def main(json_path: JsonPath = None, quick: Quick = False) -> None:
    """Learning from simulated users through the gateway: the online estimator against baselines."""
    run(quick=quick, json_path=json_path)
