"""Preference losses of the offline DPO stage: DPO (sigmoid) and IPO, as pure functions of sequence log-probs.

Pair p is a chosen (preferred) continuation y⁺ and a rejected one y⁻ of one context x. With the trained
policy π_θ, the frozen reference π_ref (the weights the stage starts from) and log π(y | x) the sum over
the response's trained tokens (or their mean, "length-normalised"; that choice is made where the sequence
log-probs are computed, `rlbus.training.dpo.sequence_logprobs`):

    h_p = (log π_θ(y⁺) − log π_ref(y⁺)) − (log π_θ(y⁻) − log π_ref(y⁻))

    DPO (Rafailov et al. 2023), conservative label smoothing ε (ε = 0: plain DPO):
        ℓ_p = −(1 − ε) · log σ(β h_p) − ε · log σ(−β h_p)
    IPO (Azar et al. 2023): regress h onto a fixed target margin instead of pushing it to infinity:
        ℓ_p = (h_p − 1 / (2β))²

    L = (1 / P) · Σ_p ℓ_p

The implicit rewards are r⁺_p = β (log π_θ(y⁺) − log π_ref(y⁺)) and r⁻_p likewise; the margin is
r⁺_p − r⁻_p = β h_p and the preference accuracy is the fraction of pairs with a positive margin. At the
start π_θ = π_ref, so h = 0, every margin is 0 and the DPO loss is log 2 for any ε.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

PreferenceKind = Literal["sigmoid", "ipo"]


@dataclass(frozen=True)
class PreferenceTerms:
    """The loss and its diagnostics for P pairs (rewards, margins and accuracy are detached)."""

    loss: torch.Tensor
    """[] L above, differentiable in the policy's log-probs."""
    chosen_rewards: torch.Tensor
    """[P] β (log π_θ(y⁺) − log π_ref(y⁺))."""
    rejected_rewards: torch.Tensor
    """[P] β (log π_θ(y⁻) − log π_ref(y⁻))."""
    margins: torch.Tensor
    """[P] chosen − rejected reward = β h."""
    accuracy: torch.Tensor
    """[] fraction of pairs whose margin is > 0."""


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    kind: PreferenceKind = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceTerms:
    """L above from per-pair sequence log-probs, each [P]; the reference's are treated as constants."""
    P = policy_chosen.shape
    if len(P) != 1 or any(t.shape != P for t in (policy_rejected, ref_chosen, ref_rejected)):
        raise ValueError(
            f"sequence log-probs must all be [P]: got {tuple(policy_chosen.shape)}, {tuple(policy_rejected.shape)}, "
            f"{tuple(ref_chosen.shape)}, {tuple(ref_rejected.shape)}"
        )
    if beta <= 0:
        raise ValueError("beta must be > 0")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError("label_smoothing must be in [0, 0.5)")
    if kind == "ipo" and label_smoothing:
        raise ValueError("label smoothing is defined for the sigmoid (DPO) loss only")
    chosen = policy_chosen.float() - ref_chosen.detach().float()  # [P] log π_θ(y⁺) − log π_ref(y⁺)
    rejected = policy_rejected.float() - ref_rejected.detach().float()  # [P]
    h = chosen - rejected  # [P]
    if kind == "sigmoid":
        per_pair = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)  # [P]
    elif kind == "ipo":
        per_pair = (h - 1 / (2 * beta)) ** 2  # [P]
    else:
        raise ValueError(f"unknown preference loss {kind!r}: expected 'sigmoid' or 'ipo'")
    chosen_rewards = beta * chosen.detach()  # [P]
    rejected_rewards = beta * rejected.detach()  # [P]
    margins = chosen_rewards - rejected_rewards  # [P]
    return PreferenceTerms(
        loss=per_pair.mean(),
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margins=margins,
        accuracy=(margins > 0).float().mean(),
    )
