"""Token-level clipped policy-gradient loss (PPO clip, as used by GRPO, with decoupled clip bounds).

For sampled tokens x_{b,t} with loss mask m_{b,t}, advantages A_b (per rollout) or A_{b,t} (per token),
the current policy's log-probs log π_θ, the proximal policy's log-probs log π_old (the trainer's weights
before this update, detached), and optional importance-sampling weights w_{b,t} (detached; from
`rlbus.rl.correction`, correcting for the behaviour policy μ that actually generated the tokens):

    r_{b,t} = exp(log π_θ(x_{b,t}) − log π_old(x_{b,t}))
    ℓ_{b,t} = − min( r_{b,t} · A,  clip(r_{b,t}, 1 − eps_low, 1 + eps_high) · A )
    L       = (1 / N) · Σ_{b,t} m_{b,t} · w_{b,t} · ℓ_{b,t},        N = Σ_{b,t} m_{b,t}

Normalisation: L is a *token-level* mean over every unmasked token of the batch (DAPO), not a mean over
sequences of per-sequence means (the original GRPO). Each token then weighs the same, so a long
response is not down-weighted relative to a short one and its tokens' gradients do not shrink with
length. With gradient accumulation pass ``num_tokens`` = the unmasked token count of the whole step, so
every micro-batch divides by the same N and the sum equals one big batch's mean.

Decoupled bounds (eps_high > eps_low, "clip-higher") let low-probability tokens with positive advantage
grow further before the clip stops them, which keeps entropy from collapsing. With one gradient step per
batch π_θ = π_old numerically, r = 1 and the loss reduces to −mean(w · A) with gradient −mean(w · A · ∇log π).
"""

from __future__ import annotations

import torch


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """L above (a scalar to minimise). Shapes: logprobs, old_logprobs, mask [B, T]; advantages [B] or [B, T].

    Masked positions may hold any value (even ±inf): they are replaced before exp, so they neither
    contribute nor poison gradients with NaN. With no unmasked tokens the loss is 0 (still a graph node).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape [B, T]"
        )
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise ValueError("clip bounds need 0 <= eps_low < 1 and eps_high >= 0")
    m = mask.bool()  # [B, T]
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # [B, T]
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights.detach()  # [B, T]
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))  # [B, T]
    denom = float(m.sum()) if num_tokens is None else num_tokens
    if denom <= 0:
        return per_token.sum() * 0.0
    return per_token.sum() / denom
