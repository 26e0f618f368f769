"""One GRPO update of the policy from scored groups, with the numerical-mismatch controls of docs/architecture.md §5.

Notation: a batch holds groups g of G samples i (rollouts of one prompt) with rewards r_{g,i}; sample i's
sampled tokens x_t (loss mask m_t) were drawn from the behaviour policy μ — the inference engine, possibly
several versions old and running other numerics — which reported log μ(x_t) and the version v_t.

    advantage     A_i   = r_i − mean_g(r)                [ / (std_g(r) + 1e−6) if normalize_std ]
    staleness     s_i   = v_trainer − min_t v_t ;   samples with s_i > max_staleness are dropped
    proximal      log π_old(x_t) = the trainer's log-prob at the start of the step: one padded forward
                  over the sequence, log softmax(z_t / τ_i) at the behaviour temperature τ_i, routing
                  each token to the engine's recorded experts when router replay is on
    IS weight     ρ = π_old / μ at token or sequence level;   TIS: w = min(ρ, C)   MIS: w = ρ · 1[a ≤ ρ ≤ b]
                  (``keep`` = the tokens MIS leaves in; every loss token under TIS)
    ratio         r_t = π_θ(x_t) / π_old(x_t)
    objective     L = (1/N) Σ_{i,t} keep_t · w_t · −min(r_t A_i, clip(r_t, 1 − ε_low, 1 + ε_high) A_i)  +  L_aux
                  N = Σ m_t over the minibatch (MIS-dropped tokens count in N: dropping data never
                  inflates the weight of the tokens that remain);  L_aux = the MoE balancing loss
    update        g = ∇L;  g ← g · min(1, max_grad_norm / ‖g‖);  AdamW on the fp32 master weights

Served traffic (`online_step`) has no groups: A_i comes from a running baseline (`rlbus.rl.online`) and
the rest of the objective is the same.

With ``minibatches = 1`` (the default) π_θ = π_old numerically, so r = 1, the clip is inactive and
∇L = −(1/N) Σ keep · w · A · ∇log π; the proximal log-probs then come from the training forward itself.
With ``minibatches > 1`` the batch is split into that many optimizer steps and π_old comes from one extra
no-grad forward before the first (decoupled PPO: the IS weight corrects μ → π_old, the clip bounds the
step π_old → π_θ). ``micro_batch_rows`` splits each minibatch into forward/backward chunks that
accumulate gradients; the policy-gradient term is unchanged (up to float rounding) because every chunk
divides by the same N, while the balancing loss is computed per chunk (its f · P product is not
additive) and weighted by the chunk's share of real tokens.

The model is any `rlbus.models.base.TrainableLM` (the in-repo policy or a Hugging Face causal LM). Its
forward stops at the final hidden states h_t; the logits z_t = h_t · Wᵀ (W = the LM head, [V, D]) exist
only ``logprob_chunk`` trained tokens at a time (`rlbus.rl.logprobs.chunked_token_logprobs`, recomputed in
backward), so no fp32 [B, S, V] tensor is ever built. ``compute_dtype = "bfloat16"`` (and ``auto``, the
default, on CUDA) runs the forward and the projection under bf16 autocast over the fp32 master weights; the
log-softmax is always fp32.

On N ranks (`rlbus.training.ranks`, FSDP2). Every rank gets the whole batch and packs it the same way;
each minibatch's rows [a, b) are cut into N contiguous slices of ⌈(b − a)/N⌉ rows, rank r trains slice r
(in ``micro_batch_rows`` chunks), and a rank with fewer chunks runs zero-weighted passes so all ranks
join the same collectives. The normalisation: rank r's loss is

    L_r = (1/N_mb) Σ_{i,t ∈ slice r} keep_t · w_t · ℓ_t  +  Σ_{chunks c of slice r} L_aux,c · T_c / T_mb

with N_mb the loss tokens and T_mb the real tokens of the *whole* minibatch (T_c: chunk c's), and FSDP
*sums* the ranks' gradients (divide factor 1), so ∇ Σ_r L_r is the one-process ∇L with the slices as
micro-batches. On two ranks, in fp32, that is exact bit for bit: a + b = b + a, so the reduce-scatter
adds what gradient accumulation adds; with more ranks (or several chunks per rank) the summation order
of the reduction differs and the gradient agrees to float rounding. The clip coefficient uses the
norm of the sharded gradient (summed over shards): when clipping is active it may differ in the last
bit. The per-row tensors behind the metrics are summed across ranks, so every rank reports the
one-process metrics.

Reported per step: loss, mean reward, KL(μ ‖ π_old) by k3, max |log π_old − log μ|, the router-flip rate
(the trainer's own top-k against the engine's experts, computed even under replay), IS-weight ESS, clip
and mask fractions, the staleness histogram, token count and gradient norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from rlbus.models.base import TrainableLM
from rlbus.rl.advantages import group_advantages
from rlbus.rl.correction import ISCorrection, masked_is, truncated_is
from rlbus.rl.logprobs import chunked_token_logprobs
from rlbus.rl.losses import clipped_pg_loss
from rlbus.rl.metrics import clip_fraction, is_ess, kl_k3, mask_fraction, max_abs_logprob_diff, router_flip_rate
from rlbus.rl.staleness import fresh_mask, staleness_histogram
from rlbus.training.batch import Group, PackedBatch, Sample, pack
from rlbus.training.config import GRPOConfig, OptimConfig
from rlbus.training.ranks import Ranks

__all__ = ["GRPOConfig", "OptimConfig", "StepMetrics", "build_optimizer", "grpo_step", "online_step"]

# ----------------------------------------------------------------------------------------------------------
# optimizer


def build_optimizer(model: TrainableLM, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW with two parameter groups: decayed (≥ 2-D) and not decayed (gains), nanoGPT's split."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


# ----------------------------------------------------------------------------------------------------------
# metrics


@dataclass(frozen=True)
class StepMetrics:
    """What one step reports (docs/architecture.md §5); `as_dict` gives JSON-ready values."""

    loss: float
    """Objective L (policy-gradient + aux), token-weighted over minibatches."""
    pg_loss: float
    aux_loss: float
    reward_mean: float
    """Mean reward over every sample of the batch (stale ones included)."""
    reward_std: float
    kl_k3: float
    """KL(μ ‖ π_old) by the k3 estimator over the trained tokens."""
    max_abs_dlogprob: float
    router_flip_rate: float | None
    """Fraction of (MoE layer, trained token) pairs whose own top-k set differs from the engine's; None
    when the batch carries no routing."""
    is_ess: float
    clip_fraction: float
    mask_fraction: float
    staleness: dict[int, int]
    """{versions behind: rollouts} over every sample with sampled tokens, before dropping."""
    stale_dropped: int
    samples: int
    rows: int
    tokens: int
    """Loss tokens of the fresh samples (the N of the objective, summed over minibatches)."""
    grad_norm: float
    """Global gradient norm before clipping (mean over minibatches)."""
    optimizer_steps: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------------------
# the step


def grpo_step(
    model: TrainableLM,
    optimizer: torch.optim.Optimizer,
    groups: Sequence[Group],
    *,
    config: GRPOConfig,
    version: int,
    ranks: Ranks | None = None,
) -> StepMetrics:
    """One update from ``groups`` (see the module docstring); ``version`` is the trainer's policy version.
    With ``ranks`` every rank calls it with the same groups and trains its slice of them (see "On N ranks")."""
    if not groups:
        raise ValueError("grpo_step needs at least one group")
    samples = [s for g in groups for s in g.samples]
    rewards = torch.cat([g.rewards.float() for g in groups])  # [R]
    advantages = torch.cat([group_advantages(g.rewards, normalize_std=config.normalize_std) for g in groups])  # [R]
    return _update(model, optimizer, samples, advantages, rewards, config=config, version=version,
                   max_staleness=config.max_staleness, ranks=ranks)


def online_step(
    model: TrainableLM,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    *,
    config: GRPOConfig,
    version: int,
    max_staleness: int,
    ranks: Ranks | None = None,
) -> StepMetrics:
    """One update from single served samples whose advantages [R] come from an online baseline
    (`rlbus.rl.online`) instead of a group; everything else — IS correction, clip, staleness drop at
    ``max_staleness``, metrics — is the GRPO step's."""
    if not samples:
        raise ValueError("online_step needs at least one sample")
    if advantages.shape != (len(samples),) or rewards.shape != (len(samples),):
        raise ValueError(f"{len(samples)} samples need advantages and rewards of shape [{len(samples)}]")
    return _update(model, optimizer, list(samples), advantages.float(), rewards.float(), config=config,
                   version=version, max_staleness=max_staleness, ranks=ranks)


def _update(
    model: TrainableLM,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    *,
    config: GRPOConfig,
    version: int,
    max_staleness: int,
    ranks: Ranks | None = None,
) -> StepMetrics:
    """The update shared by both steps: ``samples`` with their advantages [R] and rewards [R]. Its phases: pick
    the fresh samples, pack them, (with minibatches) one no-grad pass for π_old, the optimizer steps, and —
    on N ranks — summing the per-token traces every rank filled for its own rows."""
    chosen = _choose(samples, rewards, version, max_staleness)
    if not chosen.train_idx:
        return _nothing_trained(chosen.base)
    device = next(model.parameters()).device
    batch = pack([samples[i] for i in chosen.train_idx], advantages[chosen.train_idx], pad_id=config.pad_id).to(device)
    replay = config.router_replay and batch.routed_experts is not None and model.is_moe
    trace = _Trace.empty(batch, model)
    model.train()
    minibatches = _chunks(0, len(batch.inputs), math.ceil(len(batch.inputs) / config.minibatches))
    plan = [_plan(a, b, config.micro_batch_rows, ranks) for a, b in minibatches]  # this rank's pieces
    if config.minibatches > 1:
        _proximal(model, batch, trace, plan, replay=replay, config=config, ranks=ranks)
    totals = {"pg": 0.0, "aux": 0.0, "norm": 0.0}
    for minibatch, pieces in zip(minibatches, plan, strict=True):
        _optimizer_step(model, optimizer, batch, trace, minibatch, pieces, totals, replay=replay, config=config,
                        ranks=ranks)
    if ranks is not None:
        trace.sum_over(ranks, minibatches)
    return _metrics(batch, trace, totals, len(minibatches), config, chosen.base)


@dataclass(frozen=True)
class _Chosen:
    """Which samples train (fresh, with loss tokens), and the figures every step reports about all of them."""

    train_idx: list[int]
    base: dict[str, Any]


def _choose(samples: list[Sample], rewards: torch.Tensor, version: int, max_staleness: int) -> _Chosen:
    oldest = [s.oldest_version() for s in samples]
    versioned = [i for i, v in enumerate(oldest) if v is not None]
    oldest_t = torch.tensor([oldest[i] for i in versioned], dtype=torch.long)  # [R']
    histogram = staleness_histogram(version, oldest_t) if versioned else {}
    fresh = fresh_mask(version, oldest_t, max_staleness=max_staleness).tolist() if versioned else []
    train_idx = [i for i, ok in zip(versioned, fresh, strict=True) if ok and samples[i].num_loss_tokens > 0]
    base = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(correction=0)),
        "staleness": histogram,
        "stale_dropped": len(versioned) - sum(fresh),
        "samples": len(samples),
    }
    return _Chosen(train_idx, base)


def _nothing_trained(base: dict[str, Any]) -> StepMetrics:
    return StepMetrics(loss=0.0, pg_loss=0.0, aux_loss=0.0, kl_k3=0.0, max_abs_dlogprob=0.0, router_flip_rate=None,
                       is_ess=0.0, clip_fraction=0.0, mask_fraction=0.0, rows=0, tokens=0, grad_norm=0.0,
                       optimizer_steps=0, **base)


@dataclass
class _Trace:
    """Per-token values the update records for the metrics, filled row range by row range as pieces train."""

    old: torch.Tensor  # [B, S] log π_old
    ratio: torch.Tensor  # [B, S] π_θ / π_old at the time of each row's update
    weights: torch.Tensor  # [B, S] IS weights
    keep: torch.Tensor  # [B, S] bool
    own: torch.Tensor | None  # [L, B, S, k] the trainer's own top-k, for MoE batches with routing

    @classmethod
    def empty(cls, batch: PackedBatch, model: TrainableLM) -> _Trace:
        B, S = batch.inputs.shape
        device = batch.inputs.device
        own = batch.routed_experts.clone() if batch.routed_experts is not None and model.is_moe else None
        return cls(old=torch.zeros(B, S, device=device), ratio=torch.ones(B, S, device=device),
                   weights=torch.zeros(B, S, device=device), keep=torch.zeros(B, S, dtype=torch.bool, device=device),
                   own=own)

    def record_experts(self, a: int, b: int, w: int, experts: torch.Tensor | None) -> None:
        if self.own is not None and experts is not None:
            self.own[:, a:b, :w] = experts

    def sum_over(self, ranks: Ranks, minibatches: list[tuple[int, int]]) -> None:
        """Every rank filled its own rows: sum them, so each holds the whole batch's."""
        mine = torch.zeros(self.old.shape[0], dtype=torch.bool, device=self.old.device)  # [B]
        for a, b in minibatches:
            ra, rb = ranks.rows(a, b)
            mine[ra:rb] = True
        for t in (self.old, self.ratio, self.weights):
            ranks.sum(t.masked_fill_(~mine[:, None], 0.0))
        self.keep = ranks.sum((self.keep & mine[:, None]).int()).bool()
        if self.own is not None:
            ranks.sum(self.own.masked_fill_(~mine[None, :, None, None], 0))


def _proximal(
    model: TrainableLM, batch: PackedBatch, trace: _Trace, plan: list[list[tuple[int, int] | None]], *,
    replay: bool, config: GRPOConfig, ranks: Ranks | None,
) -> None:
    """``minibatches > 1``: log π_old of every row from one no-grad pass before the first optimizer step."""
    pieces = _plan(0, len(batch.inputs), config.micro_batch_rows, None) if ranks is None else [
        p for ps in plan for p in ps]
    with torch.no_grad():
        for piece in pieces:
            a, b = piece or (0, 1)
            part = batch.select(a, b)
            logp, experts, _ = _score(model, part, replay=replay, dtype=config.compute_dtype,
                                      chunk=config.logprob_chunk)
            if piece is None:  # a pass that only keeps this rank's collectives in step
                continue
            w = part.inputs.shape[1]
            trace.old[a:b, :w] = logp
            trace.record_experts(a, b, w, experts)


def _optimizer_step(
    model: TrainableLM, optimizer: torch.optim.Optimizer, batch: PackedBatch, trace: _Trace,
    minibatch: tuple[int, int], pieces: list[tuple[int, int] | None], totals: dict[str, float], *,
    replay: bool, config: GRPOConfig, ranks: Ranks | None,
) -> None:
    """One minibatch: forward and backward of this rank's pieces (gradients accumulate), clip, AdamW."""
    mb_a, mb_b = minibatch
    optimizer.zero_grad(set_to_none=True)
    mb_tokens = int(batch.loss_mask[mb_a:mb_b].sum())
    mb_real = int(batch.key_mask[mb_a:mb_b].sum())
    parts: list[tuple[float, float]] = []  # (pg, aux) · mb_tokens of each piece, in row order
    for piece in pieces:
        part_loss = _train_piece(model, batch, trace, piece or (mb_a, mb_a + 1), mb_tokens, mb_real,
                                 replay=replay, config=config, weight=0.0 if piece is None else 1.0)
        if piece is not None:
            parts.append(part_loss)
    for pg_part, aux_total in parts if ranks is None else [p for rank in ranks.gather(parts) for p in rank]:
        totals["pg"] += pg_part
        totals["aux"] += aux_total
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm if config.max_grad_norm > 0 else math.inf)
    optimizer.step()
    totals["norm"] += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _train_piece(
    model: TrainableLM, batch: PackedBatch, trace: _Trace, rows: tuple[int, int], mb_tokens: int, mb_real: int, *,
    replay: bool, config: GRPOConfig, weight: float,
) -> tuple[float, float]:
    """Forward and backward of rows [a, b); returns its (pg, aux) · mb_tokens. ``weight`` 0 is a zero-weighted
    pass (it adds exact zeros to the gradients and records nothing): a rank without rows left still joins
    the collectives."""
    a, b = rows
    part = batch.select(a, b)
    w = part.inputs.shape[1]
    logp, experts, aux = _score(model, part, replay=replay, dtype=config.compute_dtype,
                                chunk=config.logprob_chunk)  # [b-a, w]
    proximal = logp.detach() if config.minibatches == 1 else trace.old[a:b, :w]
    corr = _correct(proximal, part.behaviour_logprobs, part.loss_mask, config)
    pg = clipped_pg_loss(logp, proximal, part.advantages, corr.keep, eps_low=config.eps_low,
                         eps_high=config.eps_high, is_weights=corr.weights, num_tokens=float(max(mb_tokens, 1)))
    aux_part = torch.zeros((), device=logp.device)
    if config.aux_loss and aux is not None:
        aux_part = aux * (int(part.key_mask.sum()) / max(mb_real, 1))
    if weight == 0.0:
        ((pg + aux_part) * 0.0).backward()
        return 0.0, 0.0
    (pg + aux_part).backward()
    if config.minibatches == 1:
        trace.old[a:b, :w] = proximal
        trace.record_experts(a, b, w, experts)
    trace.ratio[a:b, :w] = (logp.detach() - trace.old[a:b, :w]).exp()
    trace.weights[a:b, :w], trace.keep[a:b, :w] = corr.weights, corr.keep
    return float(pg.detach()) * mb_tokens, float(aux_part.detach()) * mb_tokens


def _metrics(
    batch: PackedBatch, trace: _Trace, totals: dict[str, float], steps: int, config: GRPOConfig,
    base: dict[str, Any],
) -> StepMetrics:
    tokens = batch.num_loss_tokens
    mask = batch.loss_mask
    flips = None if trace.own is None or batch.routed_experts is None else router_flip_rate(
        trace.own, batch.routed_experts, mask)
    return StepMetrics(
        loss=(totals["pg"] + totals["aux"]) / max(tokens, 1),
        pg_loss=totals["pg"] / max(tokens, 1),
        aux_loss=totals["aux"] / max(tokens, 1),
        kl_k3=kl_k3(batch.behaviour_logprobs, trace.old, mask),
        max_abs_dlogprob=max_abs_logprob_diff(trace.old, batch.behaviour_logprobs, mask),
        router_flip_rate=flips,
        is_ess=is_ess(trace.weights, trace.keep),
        clip_fraction=clip_fraction(trace.ratio, batch.advantages, trace.keep, eps_low=config.eps_low,
                                    eps_high=config.eps_high),
        mask_fraction=mask_fraction(trace.keep, mask),
        rows=len(batch.inputs),
        tokens=tokens,
        grad_norm=totals["norm"] / steps,
        optimizer_steps=steps,
        **base,
    )


def score(
    model: TrainableLM,
    batch: PackedBatch,
    *,
    replay: bool,
    dtype: Literal["float32", "bfloat16"] = "float32",
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad trainer log-probs [B, S] (at the loss mask, 0 elsewhere) and own top-k experts [L, B, S, k]
    of a packed batch (for benches)."""
    with torch.no_grad():
        replay = replay and batch.routed_experts is not None
        logp, experts, _ = _score(model, batch, replay=replay, dtype=dtype, chunk=chunk)
    return logp, experts


def bf16_compute(dtype: str, device: torch.device) -> bool:
    """Whether a ``compute_dtype`` runs bf16 autocast on ``device`` (``auto``: on CUDA)."""
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")


def _score(
    model: TrainableLM, part: PackedBatch, *, replay: bool, dtype: str, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log π(targets) [B, S] at each row's temperature, at the loss mask, 0 elsewhere; own experts
    [L, B, S, k] | None; aux loss | None)."""
    device = part.inputs.device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16_compute(dtype, device)):
        routed = part.routed_experts if replay else None
        out = model.features(part.inputs, key_mask=part.key_mask, routed_experts=routed)
        logp = chunked_token_logprobs(
            out.hidden, model.output_weight(), part.targets, part.temperature, mask=part.loss_mask, chunk_tokens=chunk,
            allowed_index=part.allowed_index, allowed_bits=part.allowed_bits,
        )  # [B, S]
    return logp, out.routed_experts, out.aux_loss


def _correct(old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, config: GRPOConfig) -> ISCorrection:
    level, agg = config.is_level, config.is_seq_agg
    if config.is_mode == "tis":
        return truncated_is(old, behaviour, mask, cap=config.tis_cap, level=level, seq_agg=agg)
    if config.is_mode == "mis":
        return masked_is(old, behaviour, mask, low=config.mis_low, high=config.mis_high, level=level, seq_agg=agg)
    m = mask.bool()
    log_ratio = torch.where(m, (old - behaviour).detach(), torch.zeros_like(old))
    return ISCorrection(weights=m.float(), keep=m, log_ratio=log_ratio)


def _plan(start: int, stop: int, size: int, ranks: Ranks | None) -> list[tuple[int, int] | None]:
    """The row pieces this rank runs of rows [start, stop): its slice (all of them on one rank) in chunks of
    ``size`` rows, then None — a zero-weighted pass on one row — until it runs as many passes as the rank
    with the most: under FSDP every forward and backward is a collective that all ranks must join."""
    if ranks is None:
        return list(_chunks(start, stop, size))
    slices = [ranks.rows(start, stop, r) for r in range(ranks.world)]
    counts = [len(_chunks(a, b, size)) if b > a else 0 for a, b in slices]
    a, b = ranks.rows(start, stop)
    mine: list[tuple[int, int] | None] = list(_chunks(a, b, size)) if b > a else []
    return mine + [None] * (max(counts) - len(mine))


def _chunks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) in consecutive pieces of ``size`` rows (0 = one piece)."""
    if size <= 0 or size >= stop - start:
        return [(start, stop)]
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]
