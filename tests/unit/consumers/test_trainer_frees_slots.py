"""The trainer credits admission for groups that end untrained (`rlbus.producers.prompts`, "Groups that end
untrained"): a call that drops every rollout as stale takes no step and frees its groups' slots, a group the
join drops whole frees its slot too, and a call that trains anything frees nothing."""

from __future__ import annotations

import numpy as np
import torch

from rlbus.bus import MemoryBus
from rlbus.bus.topics import topic_specs
from rlbus.consumers.trainer import TrainerWorker
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import Rollout, TensorData
from rlbus.state import MemoryStateStore
from rlbus.state.progress import GROUPS_DONE_COUNTER, GROUPS_FREED_COUNTER
from rlbus.training.join import JoinBuffer, Outcome, RewardPolicy, ScoredGroup, ScoredRollout
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def group(prompt: str, version: int) -> ScoredGroup:
    """Two rollouts sampled on ``version``, rewards 0 and 1."""
    mask = np.zeros(8, dtype=np.uint8)
    mask[2:] = 1
    rollouts = [
        Rollout(rollout_id=f"{prompt}/{i}", prompt_id=prompt, group_index=i, group_size=2,
                token_ids=TensorData.from_numpy(np.full(8, 65 + i, dtype=np.int32)),
                loss_mask=TensorData.from_numpy(mask),
                logprobs=TensorData.from_numpy(np.where(mask == 1, -1.0, 0.0).astype(np.float32)),
                token_versions=TensorData.from_numpy(np.where(mask == 1, version, -1).astype(np.int32)))
        for i in range(2)
    ]
    return ScoredGroup(prompt, [ScoredRollout(r, float(i), {"verifier": float(i)}) for i, r in enumerate(rollouts)])


async def test_a_step_that_trains_nothing_frees_its_groups_and_one_that_trains_frees_none() -> None:
    torch.manual_seed(0)
    state = MemoryStateStore()
    trainer = Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-3), grpo=GRPOConfig(max_staleness=1))
    worker = TrainerWorker(bus=MemoryBus(topic_specs()), trainer=trainer, state=state, groups_per_step=2,
                           join=JoinBuffer(state=state, policy=RewardPolicy()))
    trainer.version = 5
    assert await worker.train([group("old-a", 3), group("old-b", 2)]) is None  # both 2+ versions behind
    assert trainer.step == 0
    assert (await state.get_counter(GROUPS_DONE_COUNTER), await state.get_counter(GROUPS_FREED_COUNTER)) == (2, 2)
    assert (await worker.join.counts())[Outcome.STALE] == 4

    metrics = await worker.train([group("old-c", 3), group("fresh", 5)])  # one stale group, one trained
    assert metrics is not None and trainer.step == 1
    assert (await state.get_counter(GROUPS_DONE_COUNTER), await state.get_counter(GROUPS_FREED_COUNTER)) == (4, 2)


async def test_a_group_dropped_whole_at_the_join_frees_its_slot() -> None:
    now = [0.0]
    state = MemoryStateStore()
    join = JoinBuffer(state=state, policy=RewardPolicy(timeout_s=5.0, min_group=2), clock=lambda: now[0])
    rollout = group("lonely", 1).rollouts[0].rollout
    await join.add_rollout(rollout)  # its sibling never arrives, nor any reward
    now[0] = 10.0
    assert await join.expire() == []
    assert (await join.counts())[Outcome.INCOMPLETE] == 1  # the one rollout that arrived
    assert (await state.get_counter(GROUPS_DONE_COUNTER), await state.get_counter(GROUPS_FREED_COUNTER)) == (1, 1)
