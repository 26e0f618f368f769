"""The run config → the builders' arguments (`rlbus.wiring`). The one place a run config's fields are read.

Every entry point that runs from a `RunConfig` — the role mains of ``rlbus worker``, the demo, the chaos
rig — passes these on, so a field means the same thing everywhere. Each ``*_args`` function returns a
`TypedDict` whose keys are keyword parameters of one builder, with that parameter's type, so mypy checks
every ``builder(**args)`` call: a misspelt key, a key the builder lacks or a value of the wrong type is a
type error, and so is a key also passed by hand. Heavy imports (torch) stay inside the functions that need
them: the prompt producer and the reward worker load this module without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import msgspec

from rlbus.blobs.base import BlobStore
from rlbus.blobs.failover import FailoverStore
from rlbus.bus.base import Bus
from rlbus.errors import ConfigError
from rlbus.launch.config import RunConfig, blob_secret
from rlbus.state import StateStore
from rlbus.wiring.infra import open_bus, open_state, open_store, with_claims

if TYPE_CHECKING:
    from rlbus.models.sources import Model, ModelSource
    from rlbus.rewards.function import RewardFunction
    from rlbus.rewards.hacks import HackPolicy
    from rlbus.rewards.judge import Judge
    from rlbus.rewards.scorers import Scorer, ScorerContext
    from rlbus.schemas import Prompt
    from rlbus.training.config import DPOConfig, FSDPConfig, GRPOConfig, OnlineConfig


def bus_for(config: RunConfig, *, region: str | None = None, client_id: str | None = None) -> Bus:
    """The run's Kafka bus (not started), with ``region`` as client-id suffix and ``client.rack``, under
    the run's namespace."""
    settings = config.bus
    if region is not None:
        settings = msgspec.structs.replace(settings, region=region)
    if client_id is not None:
        settings = msgspec.structs.replace(settings, client_id=client_id)
    return open_bus(settings, prefix=config.topic_prefix)


def state_for(config: RunConfig) -> StateStore:
    return open_state(config.state.url, key_prefix=config.state_prefix)


def store_for(config: RunConfig, environ: Mapping[str, str] | None = None) -> tuple[BlobStore, str]:
    """The blob store and how manifests name it (its URL, or the directory)."""
    if config.store.url is not None:
        secret = blob_secret(config.store, environ)
        store = open_store(config.store.url, secret=secret)
        if config.store.fallback_url is not None:
            store = FailoverStore(store, open_store(config.store.fallback_url, secret=secret))
        return store, config.store.url
    directory = str(config.store_dir())
    return open_store(directory), directory


def claims_for(config: RunConfig, bus: Bus, store: BlobStore) -> Bus:
    """``bus`` with claim checks over ``run.claim_threshold_bytes``."""
    return with_claims(bus, store, threshold_bytes=config.run.claim_threshold_bytes)


def model_source(config: RunConfig, *, progress: Callable[[str], None] | None = None) -> ModelSource:
    """The run's model (`rlbus.models.kinds.ModelSource`): the source ``[model]``'s kind makes of its options (an
    HF model's GGUF or shipped name is converted once, reporting to ``progress``), else the checkpoint's model;
    on ``[model] device``, resolved and announced (to ``progress``) once."""
    from rlbus.models.device import announce
    from rlbus.models.kinds import ModelSource, model_kind

    m = config.model
    device = announce(m.device, say=progress).device  # resolved once: every model of the role lands there
    source = model_kind(m.kind).source(m.options, device=device, progress=progress)
    if source is not None:
        return source
    if m.checkpoint is None:
        raise ConfigError("model", f"[model] of kind {m.kind!r} names no model, and there is no checkpoint")
    return ModelSource.of(initial_model(config), device=device)


def initial_model(config: RunConfig) -> Model:
    """The fp32 weights of ``model.checkpoint`` (its model included)."""
    from rlbus.training.checkpoint import load_checkpoint, model_from_state

    assert config.model.checkpoint is not None
    path = Path(config.model.checkpoint)
    try:
        state = load_checkpoint(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.checkpoint", f"cannot read {path}: {exc}") from None
    if state is None:
        raise ConfigError("model.checkpoint", f"{path} holds no checkpoint")
    try:
        model: Any = model_from_state(state)
    except ValueError as exc:
        raise ConfigError("model.checkpoint", f"{path}: {exc}") from None
    return model


class RolloutArgs(TypedDict):
    """`rlbus.wiring.rollout.rollout_stack`'s sampling and batching arguments (``[rollout]``)."""

    temperature: float
    prompts_in_flight: int
    max_batch: int
    batch_window_s: float
    engine: str
    prefix_cache_tokens: int


def rollout_args(config: RunConfig) -> RolloutArgs:
    r = config.rollout
    return RolloutArgs(temperature=r.temperature, prompts_in_flight=r.prompts_in_flight, max_batch=r.max_batch,
                       batch_window_s=r.batch_window_s, engine=r.engine, prefix_cache_tokens=r.prefix_cache_tokens)


class TrainerArgs(TypedDict):
    """`rlbus.wiring.trainer.trainer_stack`'s GRPO, publishing, checkpoint and join arguments (``[trainer]``)."""

    lr: float
    grpo: GRPOConfig
    groups_per_step: int
    publish_every: int
    keyframe_every: int
    retain_versions: int
    checkpoint_every: int
    keep_checkpoints: int
    reward_sources: Sequence[str]
    join_timeout_s: float
    ordered: bool
    online: OnlineConfig | None
    reward_weights: Mapping[str, float] | None
    invalid_judgements: str
    invalid_weight: float
    fsdp: FSDPConfig


def trainer_args(config: RunConfig) -> TrainerArgs:
    t = config.trainer
    return TrainerArgs(
        lr=t.lr, grpo=t.grpo, groups_per_step=t.groups_per_step, publish_every=t.publish_every,
        keyframe_every=t.keyframe_every, retain_versions=t.retain_versions,
        checkpoint_every=t.checkpoint_every, keep_checkpoints=t.keep_checkpoints,
        reward_sources=tuple(t.reward_sources), join_timeout_s=t.join_timeout_s, ordered=t.ordered,
        online=t.online,
        reward_weights=dict(t.reward_weights), invalid_judgements=t.invalid_judgements,
        invalid_weight=t.invalid_weight, fsdp=t.fsdp,
    )


class ProducerArgs(TypedDict):
    """`rlbus.wiring.producer.prompt_producer`'s task and admission arguments (``[task]``, ``[trainer]``). A
    version is ``publish_every`` steps of ``groups_per_step`` groups (counting steps as versions would stall
    the run once publish_every > max_staleness + 1)."""

    env: str
    env_config: dict[str, Any] | None
    prompts: str | None
    seed: int
    group_size: int
    max_staleness: int
    groups_per_version: int
    admission_slack: int


def producer_args(config: RunConfig) -> ProducerArgs:
    task, t = config.task, config.trainer
    return ProducerArgs(
        env=task.env, env_config=task.env_config, prompts=task.prompts, seed=task.seed, group_size=task.group_size,
        max_staleness=t.grpo.max_staleness, groups_per_version=t.groups_per_step * t.publish_every,
        admission_slack=t.admission_slack,
    )


class RewardArgs(TypedDict):
    """`rlbus.wiring.reward.reward_worker`'s scoring arguments (``[reward]``; its scorers built)."""

    kind: str
    concurrency: int
    scorers: list[Scorer]
    hack_policy: HackPolicy
    hack_penalty: float


def reward_args(config: RunConfig, environ: Mapping[str, str] | None = None) -> RewardArgs:
    return RewardArgs(kind=config.reward.kind, concurrency=config.reward.concurrency,
                      scorers=reward_scorers(config, environ), hack_policy=config.reward.hack_policy,
                      hack_penalty=config.reward.hack_penalty)


def scorer_context(config: RunConfig, environ: Mapping[str, str] | None = None) -> ScorerContext:
    """What the run gives every scorer beyond its own table: ``[task] seed``, ``[reward] function``, and the
    environment secrets are read from."""
    import os

    from rlbus.rewards.scorers import ScorerContext

    return ScorerContext(seed=config.task.seed, function=config.reward.function,
                         environ=os.environ if environ is None else environ)


def reward_scorers(config: RunConfig, environ: Mapping[str, str] | None = None) -> list[Scorer]:
    """The scorers ``[reward]`` names (`RewardSection.scorer_names`), each built from its own table
    (`rlbus.rewards.scorers.build_scorers`): a judge's rubric read, its backend built."""
    from rlbus.rewards.scorers import build_scorers

    reward = config.reward
    return build_scorers({name: reward.table(name) for name in reward.scorer_names()},
                         scorer_context(config, environ))


def reward_function(config: RunConfig) -> RewardFunction | None:
    """``[reward] function`` imported and checked (None without one): the reward worker's verifier, and what
    the evaluations score with."""
    from rlbus.rewards.function import RewardFunction

    return RewardFunction.load(config.reward.function) if config.reward.function is not None else None


def judge_for(config: RunConfig, environ: Mapping[str, str] | None = None) -> Judge | None:
    """The LM judge of ``[reward.judge]`` when the judge scores (None otherwise), as its scorer builds it
    (`rlbus.rewards.judge.scorer.build_judge`: the rubric read and validated, the backend built)."""
    from rlbus.rewards.judge.scorer import build_judge

    if "judge" not in config.reward.scorer_names():
        return None
    return build_judge(config.reward.judge, seed=config.task.seed, environ=environ)


class WarmStartArgs(TypedDict):
    """`rlbus.training.warm.warm_start`'s arguments: the task's reference solutions, the warm-start budget."""

    env: str
    env_config: dict[str, Any] | None
    seed: int
    steps: int
    lr: float
    teacher_error: float


def evaluation_prompts(config: RunConfig, n: int) -> list[Prompt]:
    """The prompts a run's evaluations score: the first ``n`` lines of ``[task] eval_prompts``, else ``n``
    held-out prompts of ``[task] env`` (`rlbus.envs.evaluate.held_out_prompts`)."""
    task = config.task
    if task.eval_prompts is not None:
        from rlbus.envs.tasks.jsonl import load_prompts

        return load_prompts(task.eval_prompts)[:n]
    from rlbus.envs.evaluate import held_out_prompts

    return held_out_prompts(task.env, task.env_config, seed=task.seed, n=n)


def evaluation_name(config: RunConfig) -> str:
    """What `evaluation_prompts` draws from, for a human: the file, or the environment and its config."""
    task = config.task
    return task.eval_prompts if task.eval_prompts is not None else f"{task.env} {task.env_config}"


def warm_start_args(config: RunConfig) -> WarmStartArgs:
    task, t = config.task, config.trainer
    return WarmStartArgs(env=task.env, env_config=task.env_config, seed=task.seed, steps=t.warm_steps,
                         lr=t.warm_lr, teacher_error=t.teacher_error)


def dpo_config(config: RunConfig, *, pad_id: int) -> DPOConfig:
    """``[dpo.train]``, its batch order seeded by the task and padding with the model's ``pad_id`` (the stage's
    pairs: `dpo_data_args`; its gate: ``[dpo] gate_accuracy``)."""
    return msgspec.structs.replace(config.dpo.train, seed=config.task.seed, pad_id=pad_id)


class DPODataArgs(TypedDict):
    """`rlbus.training.offline.stage_pairs`'s arguments: where the DPO stage's pairs come from and how many
    are held out."""

    data: str | None
    eval_data: str | None
    eval_fraction: float
    task_pairs: int
    env: str
    env_config: dict[str, Any] | None
    seed: int


def dpo_data_args(config: RunConfig) -> DPODataArgs:
    d, task = config.dpo, config.task
    return DPODataArgs(data=d.data, eval_data=d.eval_data, eval_fraction=d.eval_fraction, task_pairs=d.task_pairs,
                       env=task.env, env_config=task.env_config, seed=task.seed)
