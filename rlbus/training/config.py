"""The trainer's knobs as data, importable without torch: how a batch becomes an update (`GRPOConfig`) and
the optimizer (`OptimConfig`), and the offline preference stage before RL (`DPOConfig`).

`rlbus.training.step` runs them; the run config's ``[trainer.grpo]`` table (`rlbus.launch.config`) is read
into `GRPOConfig` directly, so every knob of the step is reachable from a run config and declared once.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class GRPOConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a batch of scored groups becomes one update (symbols as in the module docstring)."""

    #: Divide advantages by the group's reward std (original GRPO) instead of only centring (Dr. GRPO).
    normalize_std: bool = True
    #: ε_low: ratios below 1 − ε_low stop pushing negative-advantage tokens further down.
    eps_low: float = 0.2
    #: ε_high: ratios above 1 + ε_high stop pushing positive-advantage tokens up ("clip-higher" > ε_low).
    eps_high: float = 0.28
    #: Off-policy correction π_old/μ: ``tis`` truncates at ``tis_cap``, ``mis`` masks outside the band.
    is_mode: Literal["tis", "mis", "none"] = "tis"
    #: Ratio per token, or one ratio per sequence (context segment) shared by its tokens.
    is_level: Literal["token", "sequence"] = "token"
    #: Sequence ratio as the product of token ratios, or their geometric mean (length-normalised).
    is_seq_agg: Literal["product", "geometric"] = "geometric"
    #: TIS cap C: w = min(ρ, C).
    tis_cap: float = 2.0
    #: MIS band lower edge a: tokens (sequences) with ρ < a leave the loss.
    mis_low: float = 0.5
    #: MIS band upper edge b: tokens (sequences) with ρ > b leave the loss.
    mis_high: float = 2.0
    #: Drop rollouts whose oldest token is more than this many versions behind the trainer (a run's prompt
    #: producer admits prompts at most this far ahead, and its gateway bounds RL sessions with it).
    max_staleness: int = 2
    #: Route each token to the experts the engine used (MoE only; needs routed experts in the batch).
    router_replay: bool = True
    #: Add the model's MoE load-balancing loss (its coefficient lives in the model config).
    aux_loss: bool = True
    #: Optimizer steps per batch; > 1 adds a no-grad proximal forward and makes the PPO clip active.
    minibatches: int = 1
    #: Rows per forward/backward chunk (gradient accumulation); 0 = a whole minibatch at once.
    micro_batch_rows: int = 0
    #: Trained tokens per chunk of the vocabulary projection: the fp32 logits held at once are
    #: ``logprob_chunk × V`` (and recomputed in backward), never the full batch's.
    logprob_chunk: int = 1024
    #: Recompute each block's activations in backward instead of keeping them (memory for ~⅓ more
    #: compute); the trainer sets it on the model once, at start.
    gradient_checkpointing: bool = False
    #: Clip the global gradient norm to this; 0 = no clipping (the norm is still reported).
    max_grad_norm: float = 1.0
    #: Forward precision: ``bfloat16`` (bf16 autocast over the fp32 master weights), ``float32``, or ``auto``:
    #: bf16 on CUDA (its matrix units), fp32 on the CPU.
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: Id fed at padding positions (any valid id: they are masked).
    pad_id: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError("eps_low must be in [0, 1) and eps_high >= 0")
        if self.tis_cap <= 0 or not 0 <= self.mis_low < self.mis_high:
            raise ValueError("tis_cap must be > 0 and 0 <= mis_low < mis_high")
        if self.max_staleness < 0 or self.minibatches < 1 or self.micro_batch_rows < 0:
            raise ValueError("max_staleness and micro_batch_rows must be >= 0, minibatches >= 1")
        if self.max_grad_norm < 0:
            raise ValueError("max_grad_norm must be >= 0 (0 = off)")
        if self.logprob_chunk < 1:
            raise ValueError("logprob_chunk must be >= 1")


class OptimConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """AdamW over the fp32 master weights."""

    #: Learning rate (constant).
    lr: float = 1e-5
    #: Adam (β1, β2).
    betas: tuple[float, float] = (0.9, 0.95)
    #: Adam ε.
    eps: float = 1e-8
    #: Decoupled weight decay, applied to matrices and embeddings only (not to norms' gains).
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("lr and eps must be > 0, weight_decay >= 0")


class DPOConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The offline DPO stage (`rlbus.training.dpo`; objective in `rlbus.rl.preference`). A run config's
    ``[dpo.train]`` table is read into it directly (`rlbus.launch.config.DPOSection`), so these checks are the
    config's too."""

    #: β: the strength of the KL-like pull to the reference; the implicit reward is β·(log π − log π_ref).
    beta: float = 0.1
    #: ``sigmoid`` = DPO (Rafailov et al.), ``ipo`` = IPO (Azar et al.): (h − 1/(2β))².
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    #: ε of conservative DPO: the preference label is taken to be flipped with probability ε (sigmoid only).
    label_smoothing: float = 0.0
    #: Score a response by the mean of its tokens' log-probs instead of their sum.
    length_normalize: bool = False
    #: AdamW learning rate (constant).
    lr: float = 1e-6
    #: Adam (β1, β2).
    betas: tuple[float, float] = (0.9, 0.95)
    #: Decoupled weight decay.
    weight_decay: float = 0.0
    #: Pairs per optimizer step (their chosen and rejected sides go through one forward).
    batch_size: int = 8
    #: Optimizer steps (0: a run has no DPO stage; ``rlbus train dpo`` runs 100 when its config gives none).
    steps: int = 0
    #: Seeds the batch order (a fresh permutation of the pairs each epoch).
    seed: int = 0
    #: Trained tokens per chunk of the vocabulary projection (`rlbus.rl.logprobs.chunked_token_logprobs`).
    logprob_chunk: int = 1024
    #: Forward precision: ``bfloat16`` (bf16 autocast over the fp32 master weights), ``float32``, or ``auto``:
    #: bf16 on CUDA (its matrix units), fp32 on the CPU.
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: Clip the global gradient norm to this; 0 = no clipping (the norm is still reported).
    max_grad_norm: float = 1.0
    #: Add the model's MoE load-balancing loss to the preference loss.
    aux_loss: bool = True
    #: Evaluate the held-out pairs every this many steps (and always at the start and the end); 0 = only then.
    eval_every: int = 0
    #: Id fed at padding positions (any valid id: they are masked).
    pad_id: int = 0

    def __post_init__(self) -> None:  # each message starts with the field it is about (config errors name it)
        for name in ("beta", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError("label_smoothing must be in [0, 0.5)")
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError('label_smoothing must be 0 with loss = "ipo" (it smooths the sigmoid loss only)')
        for name in ("batch_size", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("steps", "eval_every", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


class OnlineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Training on served traffic (``[trainer.online]``): single served rollouts joined with late user
    rewards, advantages from a running baseline (`rlbus.rl.online`), a version every N rewards or T seconds."""

    #: Route served rollouts (``metadata.origin = "served"``) to the online path; off: they go to the GRPO join.
    enabled: bool = False
    #: Reward sources a served rollout waits for (any one of them releases it; the first to arrive wins).
    sources: tuple[str, ...] = ("user",)
    #: ``ema``: REINFORCE with a running (EMA) baseline; ``loo``: leave-one-out over a sliding window.
    estimator: Literal["ema", "loo"] = "ema"
    #: What a baseline is kept per: the task key (``metadata.task`` or the prompt id), the tenant, or all traffic.
    baseline: Literal["task", "tenant", "global"] = "task"
    #: α of the EMA baseline: b ← (1 − α)·b + α·r.
    ema: float = 0.1
    #: Rewards per key in the leave-one-out window.
    window: int = 64
    #: Rewards a key needs before its own baseline replaces the global one.
    min_count: int = 8
    #: The baseline before any reward (0.5 = neutral between thumbs down 0 and up 1).
    baseline_init: float = 0.5
    #: Drop a served rollout older than this (its created_at to training time), rated or not.
    max_age_s: float = 86_400.0
    #: Versions a served rollout may lag at training time (user rewards come late, so larger than GRPO's).
    max_staleness: int = 16
    #: Train and publish a version once this many rewarded samples wait …
    release_every_rewards: int = 32
    #: … or once this many seconds passed since the last release with at least one waiting, whichever first.
    release_every_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("sources must name at least one reward source")
        if not 0 < self.ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        for name in ("window", "release_every_rewards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_age_s", "release_every_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.min_count < 0 or self.max_staleness < 0:
            raise ValueError(f"{'min_count' if self.min_count < 0 else 'max_staleness'} must be >= 0")


class FSDPConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a trainer on several ranks shards the model (``[trainer.fsdp]``; only read when ``[trainer]
    world_size`` > 1): FSDP2's ``fully_shard`` per transformer block and on the root, with this mixed
    precision (`rlbus.training.ranks.shard_model`)."""

    #: dtype the all-gathered parameters are computed in; ``float32`` keeps the master precision, so a
    #: sharded step computes exactly what the one-process step does (the default, and what CPU runs want).
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    #: dtype gradients are reduce-scattered in; ``bfloat16`` halves the traffic and rounds the sum.
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
