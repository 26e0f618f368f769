"""GRPO group advantages.

A prompt is sampled G times; the rewards of the group are the baseline for each other. For rollout i of a
group with rewards r_1..r_G:

    A_i = r_i − mean(r)                              (normalize_std = False)
    A_i = (r_i − mean(r)) / (std(r) + eps)           (normalize_std = True)

std is the *population* standard deviation (divide by G, not G − 1), so a group of one is defined
(A = 0) and the scale does not depend on G; libraries using the sample std differ by sqrt(G / (G − 1)).
Dividing by std (the original GRPO) up-weights groups whose rewards barely differ; leaving it out
(Dr. GRPO) keeps the advantage in reward units. A group whose rewards are all equal gets A = 0 either way:
it carries no learning signal.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for ``rewards`` [G] (one group) or [num_groups, G]; same shape, float32."""
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards must be [G] or [num_groups, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[-1] == 0:
        raise ValueError("a group needs at least one reward")
    r = rewards.float()
    adv = r - r.mean(dim=-1, keepdim=True)  # [..., G]
    if normalize_std:
        adv = adv / (r.std(dim=-1, correction=0, keepdim=True) + eps)  # [..., G]
    return adv
