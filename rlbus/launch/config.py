"""The run config: one TOML file every process of a distributed run reads.

Tables (each optional; defaults equal ``rlbus demo``'s, so a file with only ``[bus]``, ``[state]`` and
``[store]`` runs the demo's task and model distributed)::

    [bus]      Kafka connection (rlbus.config.KafkaBusConfig: bootstrap, SASL/TLS, compression …)
    [state]    url = "redis://host:6379/0" (or "memory://" for a single process), key_prefix
    [store]    dir = "/shared/blobs"  or  url = "http://blobs:8470" (+ the HMAC secret, see below)
    [task]     env (a built-in name, an ``rlbus.envs`` entry point or ``"mypkg.tasks:Class"``), env_config,
               group_size, seed, prompts (a JSONL prompt file instead of the task's generator)
    [model]    kind = "policy" (PolicyConfig fields over the demo's shape), "hf" (name | path | gguf) or a user's
               kind (rlbus.models.kinds), device, or checkpoint = "DIR" written by `rlbus pretrain` / the trainer
    [trainer]  lr, groups_per_step, admission, publish_every, checkpoint_dir, checkpoint_every,
               reward_sources, reward_weights, invalid_judgements, join_timeout_s, warm_steps (when starting
               without a checkpoint) …
    [trainer.grpo]  the GRPO step (max_staleness — also the admission bound —, normalize_std, is_mode,
               router_replay, minibatches, micro_batch_rows, compute_dtype …: rlbus.training.config.GRPOConfig)
    [trainer.online]  training on served traffic: enabled, estimator, baseline, max_age_s, release cadence …
               (rlbus.training.config.OnlineConfig)
    [dpo]      the offline preference stage before RL: data, eval_data, task_pairs, gate_accuracy …
    [dpo.train]  how it trains: steps (0: no stage), beta, loss, lr, batch_size …
               (rlbus.training.config.DPOConfig)
    [rollout]  temperature, prompts_in_flight, max_batch, engine (a registered engine: rlbus.engines.kinds) …
    [reward]   kind = "verifier" | "judge" | "both" | a user's scorer (rlbus.rewards.scorers), scorers (several),
               concurrency, function (a user's reward function by import path, in the verifier's place);
               [reward.judge] the LM judge (rubric, backend …); [reward.<name>] a user scorer's own table
    [run]      run_dir (the run log), namespace (prefix of topics, groups and Redis keys), metrics_port,
               heartbeat_s, claim_threshold_bytes

Every table rejects unknown fields and every error names the field (``ConfigError("trainer.lr", …)``).
The connection settings may be overridden from the environment, which wins over the file (containers
and ``rlbus up`` set them): ``RLBUS_KAFKA_BOOTSTRAP`` → ``bus.bootstrap``, ``RLBUS_REDIS_URL`` →
``state.url``, ``RLBUS_BLOB_URL`` → ``store.url`` (and clears ``store.dir``), ``RLBUS_BLOB_FALLBACK_URL`` →
``store.fallback_url``; ``rlbus up`` also hands its
children the run's ``RLBUS_NAMESPACE`` → ``run.namespace`` and ``RLBUS_RUN_DIR`` → ``run.run_dir``;
``RLBUS_METRICS_PORT`` / ``RLBUS_METRICS_HOST`` set the metrics endpoint (compose: 9400 on 0.0.0.0). The
blob store's HMAC secret is never a config value or a command-line flag: it comes from the file
``store.secret_file`` or from ``RLBUS_BLOB_SECRET``. Nothing here imports torch: the prompt producer and
the reward worker load this module too.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlbus.config import KafkaBusConfig, did_you_mean, parse, secret_from
from rlbus.engines.kinds import ENGINES
from rlbus.errors import ConfigError
from rlbus.models.config import DEMO_SHAPE
from rlbus.models.kinds import model_kind
from rlbus.rewards.judge.scorer import JudgeConfig
from rlbus.rewards.scorers import ALIASES, SCORERS, expand, scorer_config
from rlbus.training.config import DPOConfig, FSDPConfig, GRPOConfig, OnlineConfig

ENV_BOOTSTRAP = "RLBUS_KAFKA_BOOTSTRAP"
ENV_REDIS = "RLBUS_REDIS_URL"
ENV_BLOB_URL = "RLBUS_BLOB_URL"
ENV_BLOB_SECRET = "RLBUS_BLOB_SECRET"
ENV_BLOB_FALLBACK_URL = "RLBUS_BLOB_FALLBACK_URL"
#: Files holding the Redis URL (with a password in it) and the blob secret: Docker's ``*_FILE`` convention,
#: for secrets mounted from a volume (docker-compose.secure.yml) instead of sitting in the environment.
ENV_REDIS_FILE = "RLBUS_REDIS_URL_FILE"
ENV_BLOB_SECRET_FILE = "RLBUS_BLOB_SECRET_FILE"
ENV_NAMESPACE = "RLBUS_NAMESPACE"
ENV_RUN_DIR = "RLBUS_RUN_DIR"
ENV_METRICS_PORT = "RLBUS_METRICS_PORT"
ENV_METRICS_HOST = "RLBUS_METRICS_HOST"
#: A TOML file whose ``[bus]`` table overlays the run config's (a role's Kafka credential: ``rlbus up --secure``,
#: ``rlbus topics create --acls``). Applied before ``RLBUS_KAFKA_BOOTSTRAP``.
ENV_BUS_CONFIG = "RLBUS_BUS_CONFIG"

_STRUCT: dict[str, Any] = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}


class StateSection(msgspec.Struct, **_STRUCT):
    """Where the join buffer, ledger and counters live."""

    #: ``redis://host:port/db`` (``rediss://``, ``unix://``), or ``memory://`` for a single process.
    url: str = "redis://127.0.0.1:6379/0"
    #: Prefix of every Redis key; default ``rlbus:`` plus ``<namespace>:`` when the run has one.
    key_prefix: str | None = None

    def __post_init__(self) -> None:
        if not (self.url == "memory://" or self.url.startswith(("redis://", "rediss://", "unix://"))):
            raise ValueError(f"url {self.url!r} must be memory:// or redis://host:port/db")


class StoreSection(msgspec.Struct, **_STRUCT):
    """The blob store weight chunks go through: a shared directory or a `rlbus blobs serve` URL."""

    #: A directory every process can read (one machine, or a shared volume); default ``<run_dir>/blobs``.
    dir: str | None = None
    #: ``http://host:port`` of `rlbus blobs serve` (the trainer PUTs chunks, workers GET them).
    url: str | None = None
    #: A file holding the HMAC secret of ``url`` (used when ``RLBUS_BLOB_SECRET`` is not set).
    secret_file: str | None = None
    #: Where reads go when ``url`` fails — a region's workers read through their relay (``url``) and fall back
    #: to the origin here (`rlbus.blobs.failover`); the same secret signs both.
    fallback_url: str | None = None

    def __post_init__(self) -> None:
        if self.dir is not None and self.url is not None:
            raise ValueError("url and dir are exclusive: give the store as a directory or as a URL")
        for name in ("url", "fallback_url"):
            url = getattr(self, name)
            if url is not None and not re.match(r"https?://[^/\s]+", url):
                raise ValueError(f"{name} {url!r} is not an http(s)://host:port URL")
        if self.fallback_url is not None and self.url is None:
            raise ValueError("fallback_url needs url: it is where reads go when url fails")


class TaskSection(msgspec.Struct, **_STRUCT):
    """The prompts RL trains on: a built-in task's generator (``env``), or a JSONL file (``prompts``).

    With ``prompts`` the producer publishes the file's lines in order, cycling (each line names its environment,
    e.g. ``answer``: `rlbus.envs.tasks.answer`); ``env`` and ``env_config`` then only drive what still needs a
    generator — the warm start, the held-out evaluation and the DPO stage's task pairs."""

    #: Environment: a built-in name (``arith``, ``strings``, ``kv``, ``python_fn``), the name of an installed package's
    #: ``rlbus.envs`` entry point, or a user's class by import path (``"mypkg.tasks:WordProblems"``), resolved by
    #: `rlbus.envs.make_env` in every process that makes it.
    env: str = "arith"
    #: The environment's configuration (validated by the environment when prompts are generated).
    env_config: dict[str, Any] = msgspec.field(default_factory=lambda: {"digits": 1})
    #: GRPO group size G: rollouts per prompt (with ``prompts``: of lines that give no group_size).
    group_size: int = 8
    #: Seeds the prompt stream (seed + 1000; a prompt file keeps its order), the warm start and the policy's
    #: initial weights.
    seed: int = 0
    #: A JSONL prompt file (`rlbus.envs.tasks.jsonl`; a relative path is from the working directory, like every
    #: path of the config). It must exist when the config is loaded; every line is parsed and validated when the
    #: producer starts (or by `rlbus.envs.tasks.jsonl.validate_prompts`), errors naming the file and line.
    prompts: str | None = None
    #: A JSONL file of held-out prompts (same format) that the evaluations use — the demo's before/after
    #: accuracy, the DPO stage's task accuracy — instead of ``env``'s generator (seed 10,000 + ``seed``). With
    #: ``prompts`` and no ``eval_prompts`` they still evaluate on ``env``, which may be another task.
    eval_prompts: str | None = None

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError("group_size must be ≥ 2: GRPO compares rollouts within a group")
        for name in ("prompts", "eval_prompts"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                path = Path(value)
                what = "is not a file" if path.exists() else "does not exist"
                where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
                raise ValueError(f"{name} file {value!r} {what}{where}")


class ModelSection(msgspec.Struct, **_STRUCT):
    """The model every role of the run loads: ``kind`` names it (`rlbus.models.kinds`: the in-house policy,
    ``policy``, the default; a Hugging Face causal LM, ``hf``; or a user's kind), and the kind reads the rest of
    ``[model]`` into its own options.

    For the policy, the shape's fields sit in ``[model]`` itself (``d_model = 128``); each one not given keeps
    the demo's value (`rlbus.models.config.DEMO_SHAPE`). An HF model is exactly one of ``name``, ``path`` or
    ``gguf`` (`rlbus.models.hf_source.HFOptions`). ``checkpoint`` works with either kind: the weights of a
    checkpoint written by ``rlbus pretrain`` or the trainer (the checkpoint names its model).
    """

    #: ``policy`` (the in-house byte-level transformer), ``hf`` (a Hugging Face causal LM), the name of an
    #: installed package's ``rlbus.models`` entry point, or a user's kind by import path (``"mypkg.models:Kind"``).
    kind: str = "policy"
    #: A checkpoint file or directory (`rlbus pretrain --out DIR`); its model and weights are used.
    checkpoint: str | None = None
    #: Where the model runs: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1`` …
    #: (`rlbus.models.device`: resolved once per role, logged at start).
    device: str = "auto"
    #: The kind's own fields of ``[model]``, as its options (`ModelKind.parse`): the policy's
    #: `rlbus.models.config.PolicyConfig` (None with a checkpoint), an HF model's `HFOptions` (name, path, gguf).
    options: Any = msgspec.field(default_factory=lambda: DEMO_SHAPE)


class TrainerSection(msgspec.Struct, **_STRUCT):
    """The trainer: GRPO settings, versions, checkpoints, the join."""

    #: Adam learning rate of the RL steps.
    lr: float = 3e-4
    #: Complete groups per GRPO step.
    groups_per_step: int = 8
    #: The version admission control counts from (rlbus.producers.prompts): ``served`` — the lowest
    #: version the live rollout workers hold, so a worker still staging a delta holds new prompts back
    #: instead of generating rollouts the trainer will drop; ``published`` — the trainer's newest version
    #: (AReaL's rule as published; budget the weight-sync lag with admission_slack then).
    admission: Literal["served", "published"] = "served"
    #: Versions of weight-sync lag admission budgets beyond what it observes (0..grpo.max_staleness).
    admission_slack: int = 0
    #: Steps per published weight version.
    publish_every: int = 1
    #: The GRPO step (``[trainer.grpo]``: max_staleness — versions a rollout may lag, also the bound of
    #: admission control and of the gateway's RL sessions —, normalize_std, is_mode, tis_cap, mis_low/high,
    #: eps_low/high, router_replay, minibatches, micro_batch_rows, compute_dtype, max_grad_norm …; see
    #: `rlbus.training.config.GRPOConfig`).
    grpo: GRPOConfig = msgspec.field(default_factory=GRPOConfig)
    #: Directory of the trainer's checkpoints; a restart restores the newest. None: no checkpoints.
    checkpoint_dir: str | None = None
    #: Steps per checkpoint (with checkpoint_dir); a graceful stop always writes one. With the ordered join,
    #: a step's rollouts count as trained once a checkpoint holds the step (their groups stay in the state
    #: store until then), so a crash never loses or repeats an update (rlbus/training/join.py).
    checkpoint_every: int = 10
    #: Checkpoint files kept.
    keep_checkpoints: int = 2
    #: Reward sources every rollout waits for before its group is complete.
    reward_sources: list[str] = msgspec.field(default_factory=lambda: ["verifier"])
    #: Weight of each reward source in a rollout's scalar reward (a source not named: 1.0).
    reward_weights: dict[str, float] = msgspec.field(default_factory=dict)
    #: A judgement published invalid (`rlbus.rewards.judge`): ``drop`` the rollout (outcome
    #: dropped_invalid_judgement), ``downweight`` it (the source's value moves to its group's mean valid
    #: value, keeping invalid_weight of its own), or ``wait`` for a valid judgement (another judge worker).
    invalid_judgements: Literal["drop", "downweight", "wait"] = "drop"
    #: With ``downweight``: the share of an invalid judgement's own value kept (0: neutral, the other sources
    #: decide the rollout's advantage).
    invalid_weight: float = 0.0
    #: Seconds after a group's first message before the join releases it incomplete.
    join_timeout_s: float = 60.0
    #: Release complete groups in prompt order (what makes a replay reproduce the trainer's inputs).
    ordered: bool = True
    #: Supervised warm-start steps when neither checkpoint_dir nor model.checkpoint has weights.
    warm_steps: int = 400
    #: Learning rate of the warm start.
    warm_lr: float = 3e-3
    #: Fraction of warm-start answers the "sloppy teacher" gets wrong by one (`rlbus.training.warm`);
    #: 0 = a clean teacher. `rlbus demo` runs with 0.55 to leave RL something visible to fix.
    teacher_error: float = 0.0
    #: Every K-th version also ships a keyframe (a full snapshot) for late joiners.
    keyframe_every: int = 20
    #: Versions kept in the blob store (the newest keyframe and later are always kept).
    retain_versions: int = 5
    #: torch intra-op threads (1: several processes share a small machine).
    torch_threads: int = 1
    #: Training on served traffic with late user rewards (``[trainer.online]``: enabled, estimator, baseline,
    #: ema, window, max_age_s, max_staleness, release_every_rewards, release_every_s …; see
    #: `rlbus.training.config.OnlineConfig` and docs/online.md).
    online: OnlineConfig = msgspec.field(default_factory=OnlineConfig)
    #: Ranks the trainer runs on (docs/ranks.md): 1 = one process; N > 1 = FSDP2 over N
    #: processes that `rlbus up` starts with ``torch.distributed.run --nproc-per-node N`` (gloo on CPU, NCCL on
    #: GPU); rank 0 alone is on the bus. ``rlbus worker trainer`` must then run under torchrun with N ranks.
    #: 0 = one rank per GPU the trainer's machine has (1 without one).
    world_size: int = 1
    #: With world_size > 1: every rank uploads the weight chunks it encoded to the blob store itself (each
    #: rank's egress, docs/ranks.md); false: the other ranks hand theirs to rank 0, which
    #: uploads them, and never open the blob store.
    rank_uploads: bool = False
    #: How N ranks shard the model (``[trainer.fsdp]``: param_dtype, reduce_dtype; see
    #: `rlbus.training.config.FSDPConfig`). Read only when world_size > 1.
    fsdp: FSDPConfig = msgspec.field(default_factory=FSDPConfig)

    def __post_init__(self) -> None:
        positive = ("lr", "groups_per_step", "publish_every", "checkpoint_every", "keep_checkpoints",
                    "join_timeout_s", "warm_lr", "keyframe_every", "retain_versions", "torch_threads")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.world_size < 0:
            raise ValueError("world_size must be ≥ 0 (0: one rank per GPU)")
        if self.warm_steps < 0:
            raise ValueError("warm_steps must be ≥ 0")
        if not 0 <= self.admission_slack <= self.grpo.max_staleness:
            raise ValueError(f"admission_slack must be in 0..grpo.max_staleness ({self.grpo.max_staleness})")
        if not 0.0 <= self.teacher_error <= 1.0:
            raise ValueError("teacher_error must be in [0, 1]")
        if not self.reward_sources:
            raise ValueError("reward_sources must name at least one source")
        unknown = sorted(set(self.reward_weights) - set(self.reward_sources))
        if unknown:
            raise ValueError(f"reward_weights names {unknown}, which are not in reward_sources")
        if not 0.0 <= self.invalid_weight <= 1.0:
            raise ValueError("invalid_weight must be in [0, 1]")


class DPOSection(msgspec.Struct, **_STRUCT):
    """The offline preference stage between the warm start (SFT) and RL (`rlbus.training.dpo`).

    The trainer runs it when ``train.steps > 0`` (after the warm start, before its first version); ``rlbus
    train dpo`` runs it alone and writes a checkpoint RL starts from (``model.checkpoint``). The quality gate
    holds RL back until the held-out preference accuracy reaches ``gate_accuracy``.
    """

    #: Preference JSONL: {"prompt", "chosen", "rejected"} as text or chat messages, or token pairs written by
    #: ``rlbus offline pairs``. None: pairs from the task itself (reference answer vs the sloppy teacher's).
    data: str | None = None
    #: Held-out preference JSONL; None: ``eval_fraction`` of the training pairs is held out.
    eval_data: str | None = None
    #: Share of the pairs held out for evaluation when ``eval_data`` is not given.
    eval_fraction: float = 0.1
    #: Pairs drawn from the task when ``data`` is None.
    task_pairs: int = 400
    #: Held-out preference accuracy RL waits for (0: no gate); below it the trainer stops with an error.
    gate_accuracy: float = 0.0
    #: How the stage trains (``[dpo.train]``: steps — 0, the default, is no DPO stage —, beta, loss
    #: (``sigmoid`` | ``ipo``), label_smoothing, length_normalize, lr, betas, weight_decay, batch_size,
    #: compute_dtype, max_grad_norm, eval_every …; see `rlbus.training.config.DPOConfig`, whose checks are
    #: this table's). Its batch order is seeded by ``task.seed`` and it pads with the model's pad id.
    train: DPOConfig = msgspec.field(default_factory=DPOConfig)

    def __post_init__(self) -> None:
        if self.task_pairs < 2:
            raise ValueError("task_pairs must be ≥ 2")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in (0, 1)")
        if not 0.0 <= self.gate_accuracy <= 1.0:
            raise ValueError("gate_accuracy must be in [0, 1]")


class RolloutSection(msgspec.Struct, **_STRUCT):
    """Rollout workers: sampling and batching."""

    #: Sampling temperature (the trainer scores at the same temperature).
    temperature: float = 1.0
    #: Prompts a worker plays at once (each a group of G episodes).
    prompts_in_flight: int = 2
    #: Largest merged decode batch of the batching engine.
    max_batch: int = 64
    #: Seconds the batching engine waits to merge concurrent calls.
    batch_window_s: float = 0.003
    #: Threads for concurrent episodes (at least prompts_in_flight × G).
    episode_threads: int = 64
    #: torch intra-op threads.
    torch_threads: int = 1
    #: Inference engine (`rlbus.engines.kinds`): ``torch`` (in-process, the project's environment), ``vllm``
    #: (vLLM in its own environment, ``make vllm-env``: `rlbus up` starts these workers with its python; needs
    #: an HF model), the name of an installed package's ``rlbus.engines`` entry point, or a user's engine kind
    #: by import path (``"mypkg.engines:MyEngine"``). Checked by name when the config loads (nothing imported).
    engine: str = "torch"
    #: torch engine: tokens of finished rows' keys/values kept for prompts that extend them
    #: (`rlbus.engines.prefix`): a multi-turn episode's next turn prefills only what it added. 0 = off;
    #: SmolLM2 in bf16 holds 23 KB a token (30 layers × K, V × 3 heads × 64), so 65536 tokens take 1.5 GB.
    #: vLLM caches prefixes itself.
    prefix_cache_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "prompts_in_flight", "max_batch", "episode_threads", "torch_threads"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        ENGINES.require(self.engine)


#: ``[reward.judge]``: the judge scorer's own table (`rlbus.rewards.judge.scorer.JudgeConfig`).
JudgeSection = JudgeConfig


class RewardSection(msgspec.Struct, **_STRUCT):
    """Reward workers: which scorers (`rlbus.rewards.scorers`) score each rollout, and how."""

    #: What the reward workers score with, and their consumer group (``reward-<kind>``): ``verifier`` (the
    #: prompt's environment scores it), ``judge`` (the LM judge of ``[reward.judge]``), ``both`` (each rollout
    #: gets both rewards; the trainer's ``reward_sources`` say which it waits for), or a user's scorer — an
    #: installed package's ``rlbus.scorers`` entry point, or ``"mypkg.rewards:MyScorer"``. With ``scorers``,
    #: only the group's name.
    kind: str = "verifier"
    #: Several scorers for one worker, each rollout scored by all of them concurrently (``["verifier",
    #: "length"]``); [] scores with what ``kind`` names. With scorers, give ``kind`` a name of its own (the
    #: group ``reward-<kind>``), unless it names the same scorers.
    scorers: list[str] = msgspec.field(default_factory=list)
    #: Rollouts scored at once.
    concurrency: int = 8
    #: The LM judge (when ``judge`` scores: kind = "judge" or "both").
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    #: A user's reward function by import path, ``"mypkg.rewards:score"``: ``score(prompt, completion,
    #: reference) -> float`` (or async), scoring in the environment's place (kind = "verifier" or "both"; the
    #: reward's source stays ``verifier``). Imported when the config is loaded, so every process needs the
    #: package (installed, or on PYTHONPATH): `rlbus.rewards.function.RewardFunction`.
    function: str | None = None
    #: What a reward becomes when its environment's hack monitor found reward hacking in the rollout (the
    #: coding environment: `rlbus.envs.swe.grading.monitor`): ``zero`` (0, the default), ``penalty`` (the value less
    #: ``hack_penalty``, not below 0) or ``flag`` (unchanged; only counted and reported).
    hack_policy: Literal["zero", "penalty", "flag"] = "zero"
    #: With ``hack_policy = "penalty"``: what is taken off the reward, in [0, 1].
    hack_penalty: float = 0.5
    #: A user scorer's own table, written ``[reward.<name>]`` (parsed into its ``config_type`` when the config
    #: loads; errors name ``reward.<name>.<field>``).
    options: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.hack_penalty <= 1.0:
            raise ConfigError("reward.hack_penalty", "must be in [0, 1] (rewards are in [0, 1])")
        field = "reward.scorers" if self.scorers else "reward.kind"
        names = self.scorer_names()
        if len(set(names)) < len(names):
            raise ConfigError(field, f"names a scorer twice: {names}")
        for name in names:
            SCORERS.require(name, field=field)
        if self.scorers and (SCORERS.knows(self.kind) or self.kind in ALIASES) and expand([self.kind]) != names:
            raise ConfigError("reward.kind", f"names the scorers {expand([self.kind])}, not {names}: give the worker "
                              f"a kind of its own (its consumer group is reward-<kind>), e.g. kind = "
                              f"\"{'-'.join(names)}\"")
        for name in self.options:
            if name not in names:
                raise ConfigError(f"reward.{name}", f"a table of the scorer {name!r}, which does not score here "
                                  f"(scorers: {', '.join(names)})")
        for name in names:
            scorer_config(name, self.table(name), field=field)
        if self.function is not None:
            if "verifier" not in names:
                raise ConfigError("reward.function", 'replaces the verifier: only with kind = "verifier" or "both"')
            from rlbus.rewards.function import RewardFunction

            RewardFunction.load(self.function)

    def scorer_names(self) -> list[str]:
        """The scorers each rollout is scored with: ``scorers``, else what ``kind`` names."""
        return expand(self.scorers or [self.kind])

    def table(self, name: str) -> Any:
        """Scorer ``name``'s table: a built-in scorer's declared struct (``judge``), else ``[reward.<name>]``."""
        declared = getattr(self, name) if name in self.__struct_fields__ else None
        return declared if isinstance(declared, msgspec.Struct) else self.options.get(name, {})


class ServeSection(msgspec.Struct, **_STRUCT):
    """The OpenAI-compatible gateway (`rlbus serve`, rlbus/serve/)."""

    #: Interface to listen on (``0.0.0.0`` in containers).
    host: str = "127.0.0.1"
    #: Port of ``/v1/chat/completions``.
    port: int = 8000
    #: File of ``tenant: token`` lines (else ``$RLBUS_SERVE_TOKENS``); never the tokens themselves.
    token_file: str | None = None
    #: The name clients put in ``model`` (default: the model's own name).
    model_name: str | None = None
    #: Treat the request's ``user`` field as an RL session id when no ``X-RL-Session`` header is sent.
    user_sessions: bool = False
    #: RL sessions open at once; more are answered 429.
    max_open_sessions: int = 1000
    #: Served records buffered while the bus is down; beyond, the oldest are dropped (counted).
    buffer_records: int = 10_000
    #: ``max_tokens`` of a request that gives none.
    default_max_tokens: int = 256
    #: Largest merged decode batch (the engine's continuous batch).
    max_batch: int = 32

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        for name in ("max_open_sessions", "buffer_records", "default_max_tokens", "max_batch"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


class RunSection(msgspec.Struct, **_STRUCT):
    """Where the run log goes and which names the run uses."""

    #: Directory of the run log (steps, inputs, rewards, weights, syncs-*); "" writes none.
    run_dir: str = "runs/distributed"
    #: Prefix of the run's topics (``<namespace>.rl.rollouts.v1``), consumer groups and Redis keys, so
    #: runs share a cluster without seeing each other; "" uses the plain names.
    namespace: str = ""
    #: Serve Prometheus ``/metrics`` on this port (0: any free port; unset: no endpoint). Containers use 9400.
    metrics_port: int | None = None
    #: Interface of the metrics endpoint (``0.0.0.0`` in containers, so Prometheus can reach it).
    metrics_host: str = "127.0.0.1"
    #: Seconds between registry heartbeats (``rlbus status``, the dashboard); workers vanish after 5×.
    heartbeat_s: float = 2.0
    #: Rollouts whose message is larger than this go to the blob store with a claim on the topic.
    claim_threshold_bytes: int = 512 * 1024

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError("metrics_port must be in 0..65535")
        if self.heartbeat_s <= 0 or self.claim_threshold_bytes < 1:
            raise ValueError("heartbeat_s and claim_threshold_bytes must be > 0")
        if self.namespace and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,98}", self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must be [A-Za-z0-9][A-Za-z0-9._-]* (≤ 99 chars)")


class RunConfig(msgspec.Struct, **_STRUCT):
    """The whole run config, one field per table."""

    #: The Kafka cluster every role connects to.
    bus: KafkaBusConfig = msgspec.field(default_factory=KafkaBusConfig)
    #: The state store (Redis) of the join, ledger and counters.
    state: StateSection = msgspec.field(default_factory=StateSection)
    #: The blob store weight chunks and claims go through.
    store: StoreSection = msgspec.field(default_factory=StoreSection)
    #: The task prompts are drawn from.
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    #: The policy trained and served.
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    #: The trainer: GRPO, versions, checkpoints, the join.
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    #: The offline DPO stage before RL.
    dpo: DPOSection = msgspec.field(default_factory=DPOSection)
    #: Rollout workers: sampling and batching.
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    #: Reward workers.
    reward: RewardSection = msgspec.field(default_factory=RewardSection)
    #: The OpenAI-compatible gateway.
    serve: ServeSection = msgspec.field(default_factory=ServeSection)
    #: The run's names, log and observability.
    run: RunSection = msgspec.field(default_factory=RunSection)

    # --- derived names -----------------------------------------------------------------------------
    @property
    def topic_prefix(self) -> str:
        """Prefix of topic and group names ("" without a namespace)."""
        return f"{self.run.namespace}." if self.run.namespace else ""

    @property
    def state_prefix(self) -> str:
        if self.state.key_prefix is not None:
            return self.state.key_prefix
        return f"rlbus:{self.run.namespace}:" if self.run.namespace else "rlbus:"

    @property
    def run_dir(self) -> Path | None:
        return Path(self.run.run_dir) if self.run.run_dir else None

    def store_dir(self) -> Path:
        """The local blob directory (``store.dir``, else ``<run_dir>/blobs``)."""
        if self.store.dir is not None:
            return Path(self.store.dir)
        return (self.run_dir or Path("runs/distributed")) / "blobs"

    def tuned(self, **tables: dict[str, Any]) -> RunConfig:
        """A copy with these fields changed, table by table (``tuned(task={"seed": 3}, trainer={"lr": 1e-3})``),
        validated as a run config file is. A ``[model]`` of another kind drops the old kind's fields."""
        merged = to_tables(self)
        for name, fields in tables.items():
            base = merged.get(name, {})
            if name == "model" and fields.get("kind", base.get("kind")) != base.get("kind"):
                base = {}
            merged[name] = {**base, **fields}
        return config_from_dict(merged, {})


SECTIONS: dict[str, type[Any]] = {
    "bus": KafkaBusConfig,
    "state": StateSection,
    "store": StoreSection,
    "task": TaskSection,
    "model": ModelSection,
    "trainer": TrainerSection,
    "dpo": DPOSection,
    "rollout": RolloutSection,
    "reward": RewardSection,
    "serve": ServeSection,
    "run": RunSection,
}


#: Fields that moved into the nested table of the struct that declares them: an old config fails naming the
#: new place (``[table] field`` → ``[table.sub] field``).
MOVED: dict[str, str] = {
    "trainer.max_staleness": "trainer.grpo.max_staleness",
    "trainer.normalize_std": "trainer.grpo.normalize_std",
    **{f"dpo.{name}": f"dpo.train.{name}" for name in (
        "steps", "beta", "loss", "label_smoothing", "length_normalize", "lr", "batch_size", "compute_dtype")},
}
#: Fields of an embedded struct that a run sets from elsewhere: giving one fails naming where it comes from.
SET_BY_THE_RUN: dict[str, str] = {
    "dpo.train.seed": "task.seed seeds the DPO stage's batch order",
    "dpo.train.pad_id": "the DPO stage pads with the model's pad id",
}


def load_config(path: Path | None, environ: Mapping[str, str] | None = None) -> RunConfig:
    """Read ``path`` (None: every default), apply the environment overrides, validate every table."""
    text = ""
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(str(path), f"cannot read the run config: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None
    return config_from_dict(raw, os.environ if environ is None else environ)


def config_from_dict(raw: Mapping[str, Any], environ: Mapping[str, str]) -> RunConfig:
    """Validate a parsed TOML document table by table (so errors name ``table.field``)."""
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(name, f"unknown table{did_you_mean(name, SECTIONS)} (the tables: {', '.join(SECTIONS)})")
        if not isinstance(value, dict):
            raise ConfigError(name, "must be a table ([name] with fields)")
    tables = {name: dict(raw.get(name, {})) for name in SECTIONS}
    kind = tables["bus"].pop("kind", "kafka")
    if kind != "kafka":
        raise ConfigError("bus.kind", f"the distributed mode runs on Kafka, not {kind!r}")
    _apply_env(tables, environ)
    for old, new in MOVED.items():
        if _given(tables, old):
            raise ConfigError(old, f"moved: set {new} (the [{new.rsplit('.', 1)[0]}] table) instead")
    for name, why in SET_BY_THE_RUN.items():
        if _given(tables, name):
            raise ConfigError(name, f"not a setting: {why}")
    model = tables.pop("model")
    tables["reward"] = _scorer_tables(tables["reward"])
    sections = {name: parse(SECTIONS[name], data, prefix=name) for name, data in tables.items()}
    return RunConfig(model=_model_section(model), **sections)


def _given(tables: Mapping[str, Any], path: str) -> bool:
    """Whether the dotted field ``path`` (``dpo.train.seed``) is in the parsed tables."""
    node: Any = tables
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


#: The ``[model]`` fields every kind has; the kind parses the others.
_MODEL_FIELDS = ("kind", "checkpoint", "device")


def _model_section(table: dict[str, Any]) -> ModelSection:
    """``[model]``: the fields every kind has, and the kind's own, parsed by the kind (named errors)."""
    common = {k: table.pop(k) for k in _MODEL_FIELDS if k in table}
    section: ModelSection = parse(ModelSection, common, prefix="model")
    options = model_kind(section.kind).parse(table, checkpoint=section.checkpoint is not None)
    return msgspec.structs.replace(section, options=options)


def _scorer_tables(table: dict[str, Any]) -> dict[str, Any]:
    """``[reward]`` with the ``[reward.<name>]`` tables of the scorers it names moved into ``options``."""
    kind, scorers = table.get("kind", "verifier"), table.get("scorers") or []
    if not (isinstance(kind, str) and isinstance(scorers, list)):
        return table  # the struct names the field
    names = set(expand([str(name) for name in scorers] or [kind]))
    own = {name: table.pop(name) for name in list(table)
           if name in names and name not in RewardSection.__struct_fields__ and isinstance(table[name], dict)}
    if own:
        table["options"] = {**table.get("options", {}), **own}
    return table


def to_tables(config: RunConfig) -> dict[str, Any]:
    """The TOML tables of ``config`` (the inverse of `config_from_dict`; ``[model]`` flat)."""
    tables: dict[str, Any] = msgspec.to_builtins(config)
    tables["bus"].pop("kind", None)
    for path in SET_BY_THE_RUN:
        *parents, name = path.split(".")
        table = tables
        for part in parents:
            table = table[part]
        table.pop(name)
    tables["reward"].update(tables["reward"].pop("options"))  # back to [reward.<name>]
    tables.pop("model")
    model = config.model
    tables["model"] = {"kind": model.kind, **({"checkpoint": model.checkpoint} if model.checkpoint else {}),
                       "device": model.device, **model_kind(model.kind).table(model.options)}
    return tables


def _apply_env(tables: dict[str, dict[str, Any]], environ: Mapping[str, str]) -> None:
    if environ.get(ENV_BUS_CONFIG):
        tables["bus"].update(_bus_overlay(Path(environ[ENV_BUS_CONFIG])))
    if environ.get(ENV_BOOTSTRAP):
        tables["bus"]["bootstrap"] = environ[ENV_BOOTSTRAP]
    redis_url = secret_from(None, None, ENV_REDIS, field="state.url", file_env=ENV_REDIS_FILE, environ=environ)
    if redis_url:
        tables["state"]["url"] = redis_url
    if environ.get(ENV_BLOB_URL):
        tables["store"]["url"] = environ[ENV_BLOB_URL]
        tables["store"].pop("dir", None)
    if environ.get(ENV_BLOB_FALLBACK_URL):
        tables["store"]["fallback_url"] = environ[ENV_BLOB_FALLBACK_URL]
    if environ.get(ENV_NAMESPACE):
        tables["run"]["namespace"] = environ[ENV_NAMESPACE]
    if environ.get(ENV_RUN_DIR):
        tables["run"]["run_dir"] = environ[ENV_RUN_DIR]
    if environ.get(ENV_METRICS_PORT):
        tables["run"]["metrics_port"] = _int(environ[ENV_METRICS_PORT], "run.metrics_port")
    if environ.get(ENV_METRICS_HOST):
        tables["run"]["metrics_host"] = environ[ENV_METRICS_HOST]


def _bus_overlay(path: Path) -> dict[str, Any]:
    """The ``[bus]`` table of the file ``$RLBUS_BUS_CONFIG`` names (its ``kind`` must be kafka)."""
    try:
        bus = tomllib.loads(path.read_text()).get("bus")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("bus", f"{ENV_BUS_CONFIG}={path}: {exc}") from None
    if not isinstance(bus, dict):
        raise ConfigError("bus", f"{ENV_BUS_CONFIG}={path} has no [bus] table")
    if bus.pop("kind", "kafka") != "kafka":
        raise ConfigError("bus.kind", f"{ENV_BUS_CONFIG}={path}: the distributed mode runs on Kafka")
    return bus


def _int(text: str, field: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(field, f"{text!r} is not an integer") from None


def blob_secret(store: StoreSection, environ: Mapping[str, str] | None = None) -> str:
    """The HMAC secret of an HTTP store: the contents of ``secret_file`` when it is given, else
    ``RLBUS_BLOB_SECRET`` (`rlbus.config.secret_from`, like every secret rlbus reads)."""
    secret = secret_from(None, store.secret_file, ENV_BLOB_SECRET, field="store.secret_file",
                         file_env=ENV_BLOB_SECRET_FILE, environ=os.environ if environ is None else environ)
    if secret is None:
        raise ConfigError("store.secret_file", f"an HTTP blob store needs a secret: set {ENV_BLOB_SECRET} or give "
                          "secret_file")
    return secret
