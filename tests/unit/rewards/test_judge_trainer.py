"""The trainer's side of invalid judgements: with ``invalid = "drop"`` a rollout whose judgement stayed
invalid gets the outcome ``dropped_invalid_judgement`` and is not trained; the rest of its group is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbus.consumers.trainer import TrainerWorker
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.schemas import Reward, Rollout, TensorData
from rlbus.state import MemoryStateStore
from rlbus.training.join import JoinBuffer, Outcome, RewardPolicy
from rlbus.training.step import GRPOConfig, OptimConfig
from rlbus.training.trainer import Trainer

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def rollout(i: int) -> Rollout:
    mask = np.zeros(8, dtype=np.uint8)
    mask[2:] = 1
    return Rollout(
        rollout_id=f"p/{i}", prompt_id="p", group_index=i, group_size=3,
        token_ids=TensorData.from_numpy(np.full(8, 65 + i, dtype=np.int32)), loss_mask=TensorData.from_numpy(mask),
        logprobs=TensorData.from_numpy(np.where(mask == 1, -1.0, 0.0).astype(np.float32)),
        token_versions=TensorData.from_numpy(np.where(mask == 1, 0, -1).astype(np.int32)),
    )


def judged(i: int, value: float, valid: bool) -> Reward:
    return Reward(reward_id=f"p/{i}:judge", rollout_id=f"p/{i}", prompt_id="p", source="judge", value=value,
                  metadata={"judge_valid": "true" if valid else "false"})


async def test_a_dropped_invalid_judgement_is_recorded_not_trained() -> None:
    state = MemoryStateStore()
    join = JoinBuffer(state=state, policy=RewardPolicy(sources=("judge",), invalid="drop"))
    torch.manual_seed(0)
    trainer = Trainer(model=Policy(CFG), optim=OptimConfig(lr=1e-3), grpo=GRPOConfig(max_staleness=100))
    worker = TrainerWorker(bus=None, trainer=trainer, join=join, state=state, groups_per_step=1)  # type: ignore[arg-type]
    group = None
    for i, (value, valid) in enumerate([(0.9, True), (0.0, False), (0.2, True)]):
        await join.add_rollout(rollout(i))
        group = await join.add_reward(judged(i, value, valid)) or group
    assert group is not None
    metrics = await worker.train([group])
    assert metrics is not None and metrics["rollouts"] == 2 and metrics["samples"] == 2
    assert metrics["reward_mean"] == pytest.approx((0.9 + 0.2) / 2)
    assert await join.outcome_of("p/1") == [Outcome.INVALID_JUDGEMENT]
    assert await join.outcome_of("p/0") == await join.outcome_of("p/2") == [Outcome.TRAINED]
    counts = await join.counts()
    assert counts[Outcome.INVALID_JUDGEMENT] == 1 and counts[Outcome.TRAINED] == 2
