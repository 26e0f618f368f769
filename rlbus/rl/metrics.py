"""Per-batch diagnostics of off-policy-ness (docs/architecture.md §5), as pure functions returning floats.

With behaviour log-probs log μ (from the engine), trainer log-probs log π, and the loss mask m over the
N = Σ m sampled tokens (which were drawn from μ):

    kl_k3        KL(μ ‖ π) ≈ (1/N) Σ m · (ρ − 1 − log ρ),  ρ = π/μ = exp(log π − log μ)
                 (Schulman's k3: unbiased under x ~ μ, and every term is ≥ 0, so it never goes negative)
    max_abs_logprob_diff   max over m of |log π − log μ|
    is_ess       (Σ w)² / (N · Σ w²) ∈ [0, 1]: effective sample size of IS weights w, as a fraction of N
                 (1 = all weights equal; 1/N = one token carries all the weight)
    clip_fraction   fraction of loss tokens whose clipped term is active in the PPO objective:
                    (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 − eps_low)
    mask_fraction   fraction of loss tokens that an MIS correction dropped: 1 − Σ keep / Σ m
    router_flip_rate   fraction of (MoE layer, loss token) pairs whose top-k expert *set* differs between the
                    trainer's own routing and the replayed (engine) routing; order within the k is ignored

Each returns 0.0 when there are no loss tokens (nothing to report is not an error).
"""

from __future__ import annotations

import torch


def _count(mask: torch.Tensor) -> int:
    return int(mask.bool().sum())


def kl_k3(behaviour_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(behaviour ‖ trainer) by the k3 estimator over the masked tokens."""
    m = mask.bool()
    if not m.any():
        return 0.0
    log_rho = (trainer_logprobs.float() - behaviour_logprobs.float())[m]  # [N]
    return float((log_rho.exp() - 1.0 - log_rho).mean())


def max_abs_logprob_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a − b| over the masked tokens."""
    m = mask.bool()
    if not m.any():
        return 0.0
    return float((a.float() - b.float())[m].abs().max())


def is_ess(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised effective sample size (Σw)² / (N Σw²) of the IS weights over the masked tokens."""
    m = mask.bool()
    n = _count(m)
    if n == 0:
        return 0.0
    w = weights.float()[m]  # [N]
    sq = float((w * w).sum())
    if sq == 0.0:
        return 0.0
    return float(w.sum()) ** 2 / (n * sq)


def clip_fraction(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float
) -> float:
    """Fraction of masked tokens where the PPO clip is active; advantages [B] or [B, T]."""
    m = mask.bool()
    n = _count(m)
    if n == 0:
        return 0.0
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(ratio)  # [B, T]
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))  # [B, T]
    return _count(clipped & m) / n


def mask_fraction(keep: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of loss tokens dropped by a masking correction (``keep`` from `masked_is`)."""
    n = _count(mask)
    if n == 0:
        return 0.0
    return 1.0 - _count(keep.bool() & mask.bool()) / n


def router_flip_rate(own: torch.Tensor, replayed: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of (layer, masked token) pairs whose expert sets differ; experts [L, B, T, k], mask [B, T]."""
    if own.shape != replayed.shape:
        raise ValueError(f"expert shapes differ: {tuple(own.shape)} vs {tuple(replayed.shape)}")
    m = mask.bool()
    n = _count(m) * own.shape[0]
    if n == 0:
        return 0.0
    a = own.long().sort(dim=-1).values  # [L, B, T, k]
    b = replayed.long().sort(dim=-1).values  # [L, B, T, k]
    flipped = (a != b).any(dim=-1)  # [L, B, T]
    return _count(flipped & m[None]) / n
