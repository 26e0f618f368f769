"""The builders (`rlbus.wiring`): plain values in, unstarted objects out, wired the way every entry point
relies on — and the entry points use them instead of wiring workers by hand."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
import torch

from rlbus.aio import wait_event
from rlbus.blobs.local import LocalStore
from rlbus.bus.memory import MemoryBus
from rlbus.bus.topics import PROMPTS
from rlbus.models.config import PolicyConfig
from rlbus.models.policy import Policy
from rlbus.models.policy_source import PolicySource
from rlbus.state.memory import MemoryStateStore
from rlbus.training.config import GRPOConfig
from rlbus.training.join import JoinBuffer
from rlbus.training.ordered import OrderedJoin
from rlbus.weights.sync import live_state
from rlbus.wiring.infra import open_bus, open_state, open_store
from rlbus.wiring.producer import prompt_producer
from rlbus.wiring.reward import reward_worker
from rlbus.wiring.rollout import rollout_stack
from rlbus.wiring.trainer import trainer_stack
from rlbus_tools.chaos.pipeline import CountingJoin

ROOT = Path(__file__).resolve().parents[3]
SHAPE = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def test_infrastructure_factories(tmp_path: Path) -> None:
    bus = open_bus(None, partitions=2)
    assert isinstance(bus, MemoryBus)
    assert isinstance(open_state("memory://"), MemoryStateStore)
    assert isinstance(open_store(str(tmp_path / "blobs")), LocalStore)


async def test_a_rollout_stack_follows_the_trainers_versions(tmp_path: Path) -> None:
    bus = open_bus(None, partitions=2)
    await bus.start()
    store = open_store(str(tmp_path / "blobs"))
    swaps: list[tuple[int, str]] = []
    trainer = trainer_stack(bus=bus, state=MemoryStateStore(), store=store, model=Policy(SHAPE), lr=1e-3,
                            grpo=GRPOConfig(), groups_per_step=2)
    rollout = rollout_stack(
        bus=bus, store=store, model=PolicySource(SHAPE), worker_id="rollout-0", seed=1,
        on_swap=lambda version, weights: swaps.append((version, str(next(weights.parameters()).dtype))),
    )
    assert rollout.sync is not None and not rollout.sync.ready.is_set()
    assert rollout.engine.policy_version == 0 and rollout.worker.worker_id == "rollout-0"
    assert await trainer.trainer.publish() == 1
    stop = asyncio.Event()
    task = asyncio.create_task(rollout.sync.run(stop))
    assert await wait_event(rollout.sync.ready, 30)
    stop.set()
    await task
    assert rollout.engine.policy_version == 1 and swaps == [(1, "torch.bfloat16")]
    await bus.close()


def test_a_rollout_stack_without_a_store_serves_the_weights_it_is_given() -> None:
    master = Policy(SHAPE)
    rollout = rollout_stack(bus=MemoryBus(), store=None, model=PolicySource(SHAPE), worker_id="w", seed=0,
                            initial=master.state_dict())
    assert rollout.sync is None
    served = live_state(rollout.weights)
    assert all(torch.equal(served[k], v.to(torch.bfloat16)) for k, v in master.state_dict().items())


@pytest.mark.parametrize(("ordered", "join_class", "expected"), [
    (False, None, JoinBuffer), (True, None, OrderedJoin), (False, CountingJoin, CountingJoin)])
def test_a_trainer_stack_picks_its_join(ordered: bool, join_class: type[JoinBuffer] | None,
                                        expected: type[JoinBuffer]) -> None:
    stack = trainer_stack(bus=MemoryBus(), state=MemoryStateStore(), store=None, model=Policy(SHAPE), lr=1e-3,
                          grpo=GRPOConfig(), groups_per_step=3, ordered=ordered, join_class=join_class,
                          checkpoint_every=5, max_steps=7)
    assert type(stack.join) is expected and stack.publisher is None
    assert stack.trainer.checkpoint_every == 0  # no checkpoint_dir: no periodic checkpoints
    assert stack.worker.groups_per_step == 3 and stack.worker.max_steps == 7


async def test_the_producer_numbers_prompts_from_where_the_run_left_off() -> None:
    bus = open_bus(None, partitions=2)
    await bus.start()
    producer = prompt_producer(bus=bus, state=MemoryStateStore(), env="arith", env_config={"digits": 1}, seed=0,
                               group_size=4, max_staleness=1_000, groups_per_version=2, start=5, limit=3)
    await producer.run(asyncio.Event())
    async with bus.consumer([PROMPTS], group=None) as consumer:
        prompts = [r.value for r in await consumer.getmany(timeout_s=0.5)]
    assert sorted(int(p.metadata["seq"]) for p in prompts) == [5, 6, 7]
    assert {p.group_size for p in prompts} == {4}
    await bus.close()


async def test_a_reward_worker_scores_with_the_run_configs_settings() -> None:
    from rlbus.envs.agent import reference_episode
    from rlbus.envs.base import env_for
    from rlbus.envs.chat import ChatFormat
    from rlbus.envs.episode import episode_to_rollout
    from rlbus.envs.tasks import generate_prompts
    from rlbus.launch.arguments import reward_args
    from rlbus.launch.config import config_from_dict

    args = reward_args(config_from_dict({"reward": {"concurrency": 3}}, {}))
    worker = reward_worker(bus=MemoryBus(), worker_id="reward-a", **args)
    assert (worker.kind, worker.group, worker.worker_id, worker._concurrency) == (
        "verifier", "reward-verifier", "reward-a", 3)
    prompt = generate_prompts("arith", seed=0, n=1, config={"digits": 1})[0]
    episode = await reference_episode(env_for(prompt), prompt, chat=ChatFormat.for_byte_tokenizer())  # type: ignore[arg-type]
    [reward] = await worker.score(episode_to_rollout(episode, prompt=prompt, group_index=0))
    assert reward.value == 1.0


#: Classes only the builders construct: an entry point that builds one by hand is a second wiring.
BUILT = {"RolloutWorker", "TrainerWorker", "Trainer", "WeightSync", "WeightPublisher", "PromptProducer",
         "RewardWorker", "TorchEngine", "BatchingEngine", "JoinBuffer", "OrderedJoin"}


@pytest.mark.parametrize("module", ["rlbus/demo.py", "rlbus/launch/roles.py", "tools/rlbus_tools/chaos/pipeline.py"])
def test_the_entry_points_wire_through_the_builders(module: str) -> None:
    tree = ast.parse((ROOT / module).read_text())
    by_hand = sorted({node.func.id for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILT})
    assert by_hand == [], f"{module} constructs {by_hand} itself: use rlbus.wiring"


#: Where each engine class may be constructed: the torch chain's one builder (and the vLLM engine kind's
#: batching engine, over vLLM).
ENGINE_BUILDERS = {"TorchEngine": {"rlbus/engines/torch_stack.py"},
                   "BatchingEngine": {"rlbus/engines/torch_stack.py", "rlbus/engines/vllm_kind.py"}}


def test_the_torch_chain_is_built_in_one_place() -> None:
    """Rollout workers, the engine judge, the evaluation, ``rlbus generate`` and the benchmarks all serve a
    model through `rlbus.engines.torch_stack`."""
    found: dict[str, set[str]] = {name: set() for name in ENGINE_BUILDERS}
    for path in sorted((ROOT / "rlbus").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in found:
                found[node.func.id].add(str(path.relative_to(ROOT)))
    assert found == ENGINE_BUILDERS


def test_a_rollout_stack_takes_the_run_configs_prefix_cache(tmp_path: Path) -> None:
    from rlbus.launch.arguments import rollout_args
    from rlbus.launch.config import load_config

    path = tmp_path / "run.toml"
    path.write_text("[rollout]\nprefix_cache_tokens = 4096\n")
    rollout = rollout_stack(bus=MemoryBus(), store=None, model=PolicySource(SHAPE), worker_id="w", seed=0,
                            **rollout_args(load_config(path, {})))
    assert rollout.engine.prefix_cache is not None and rollout.engine.prefix_cache.max_tokens == 4096
    assert rollout_stack(bus=MemoryBus(), store=None, model=PolicySource(SHAPE), worker_id="w",
                         seed=0).engine.prefix_cache is None  # off unless configured
