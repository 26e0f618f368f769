"""The trainer stack: trainer → weight publisher → join → trainer worker.

The fp32 master model and its optimizer (`Trainer`), the `WeightPublisher` that casts each version to the
inference dtype and delta-encodes it (when there is a blob store), the join of rollouts with rewards (in
arrival order, or in prompt order: `rlbus.training.ordered`), and the `TrainerWorker` that reads both topics
and trains a GRPO step every ``groups_per_step`` complete groups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbus.blobs.base import BlobStore
from rlbus.bus.base import Bus
from rlbus.state.base import StateStore

if TYPE_CHECKING:
    from rlbus.consumers.trainer import TrainerWorker
    from rlbus.models.base import TrainableLM
    from rlbus.training.config import FSDPConfig, GRPOConfig, OnlineConfig
    from rlbus.training.join import JoinBuffer, ScoredGroup
    from rlbus.training.ranks import Ranks
    from rlbus.training.shard_publish import ShardPublisher
    from rlbus.training.trainer import Trainer
    from rlbus.weights.publish import WeightPublisher


@dataclass
class TrainerStack:
    """The trainer process's parts; ``publisher`` is None when no blob store takes the weights."""

    trainer: Trainer
    publisher: WeightPublisher | None
    join: JoinBuffer
    worker: TrainerWorker


def trainer_stack(
    *,
    bus: Bus,
    state: StateStore,
    store: BlobStore | None,
    model: TrainableLM,
    lr: float,
    grpo: GRPOConfig,
    groups_per_step: int,
    store_url: str = "",
    model_id: str = "policy",
    keyframe_every: int = 20,
    retain_versions: int = 5,
    publish_every: int = 1,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 2,
    reward_sources: Sequence[str] = ("verifier",),
    join_timeout_s: float = 60.0,
    reward_weights: Mapping[str, float] | None = None,
    invalid_judgements: str = "drop",
    invalid_weight: float = 0.0,
    ordered: bool = False,
    join_class: type[JoinBuffer] | None = None,
    max_steps: int | None = None,
    expire_every_s: float = 1.0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_train: Callable[[list[ScoredGroup], dict[str, Any]], None] | None = None,
    online: OnlineConfig | None = None,
    ranks: Ranks | None = None,
    fsdp: FSDPConfig | None = None,
    overlap_publish: bool = True,
) -> TrainerStack:
    """A trainer of ``model`` (fp32 master weights) on the bus. ``ordered`` releases complete groups in
    prompt order, ``groups_per_step`` at a time; ``join_class`` swaps in a subclass of the join (the chaos
    rig's counting join). ``online`` (when enabled) also trains served rollouts with late user rewards
    (`rlbus.training.online_lane.OnlineLane`). ``ranks``: this is rank 0 of a trainer on N ranks; the model
    is sharded (``fsdp``) like the followers' (`follower_trainer`). ``overlap_publish``: each version is
    encoded and uploaded while the next step trains (`rlbus.training.trainer`, one process only)."""
    from rlbus.consumers.trainer import TrainerWorker
    from rlbus.training.config import OptimConfig
    from rlbus.training.join import JoinBuffer, RewardPolicy, ServedJoin
    from rlbus.training.online_lane import OnlineLane
    from rlbus.training.ordered import OrderedJoin
    from rlbus.training.trainer import Trainer
    from rlbus.weights.publish import WeightPublisher

    publisher = None
    if store is not None:
        publisher = WeightPublisher(bus=bus, store=store, model_id=model_id, keyframe_every=keyframe_every,
                                    retain_versions=retain_versions, store_url=store_url)
    if ranks is not None:
        model = _sharded(model, ranks, fsdp)
    trainer = Trainer(
        model=model, optim=OptimConfig(lr=lr), grpo=grpo, publisher=publisher, checkpoint_dir=checkpoint_dir,
        publish_every=publish_every, checkpoint_every=checkpoint_every if checkpoint_dir else 0,
        keep_checkpoints=keep_checkpoints, ranks=ranks, overlap_publish=overlap_publish,
    )
    policy = RewardPolicy(sources=tuple(reward_sources), weights=dict(reward_weights or {}), timeout_s=join_timeout_s,
                          invalid=invalid_judgements, invalid_weight=invalid_weight)  # type: ignore[arg-type]
    join: JoinBuffer
    if ordered:
        join = (join_class or OrderedJoin)(state=state, policy=policy, batch=groups_per_step)  # type: ignore[call-arg]
    else:
        join = (join_class or JoinBuffer)(state=state, policy=policy)
    lane = None
    if online is not None and online.enabled:
        served = ServedJoin(ledger=join, state=state, sources=online.sources, max_age_s=online.max_age_s)
        lane = OnlineLane(join=served, state=state, config=online)
    worker = TrainerWorker(bus=bus, trainer=trainer, join=join, state=state, groups_per_step=groups_per_step,
                           max_steps=max_steps, expire_every_s=expire_every_s, on_step=on_step, on_train=on_train,
                           online=lane)
    return TrainerStack(trainer=trainer, publisher=publisher, join=join, worker=worker)


def follower_trainer(
    *, model: TrainableLM, lr: float, grpo: GRPOConfig, ranks: Ranks, fsdp: FSDPConfig | None = None,
    checkpoint_dir: Path | None = None, shards: ShardPublisher | None = None,
) -> Trainer:
    """The trainer of a rank > 0 (`Trainer.follow`): the leader's model sharding and optimizer, and nothing
    of the bus — no join, no publisher, no consumer. Its checkpoint_dir is where the leader's commands
    save and restore shards; ``shards`` uploads the weight chunks it encodes (default: to rank 0)."""
    from rlbus.training.config import OptimConfig
    from rlbus.training.trainer import Trainer

    return Trainer(model=_sharded(model, ranks, fsdp), optim=OptimConfig(lr=lr), grpo=grpo,
                   checkpoint_dir=checkpoint_dir, ranks=ranks, shards=shards)


def _sharded(model: TrainableLM, ranks: Ranks, fsdp: FSDPConfig | None) -> TrainableLM:
    """``model`` with rank 0's weights on every rank, sharded with FSDP2 (the same on every rank); a model
    sharded already (the N-rank DPO stage ran on it: `rlbus.launch.roles`) as it is."""
    from torch.distributed.fsdp import FSDPModule

    from rlbus.training.config import FSDPConfig
    from rlbus.training.ranks import shard_model, share_weights

    if isinstance(model, FSDPModule):
        return model

    share_weights(model, ranks)  # type: ignore[arg-type]
    return shard_model(model, ranks, fsdp or FSDPConfig())
