"""The trainer's log-probs of sampled tokens, to compare with the engine's behaviour log-probs.

For logits z_t (the model's output at position t, which predicts token x_{t+1}) and temperature τ:

    log π(x_{t+1}) = log softmax(z_t / τ)[x_{t+1}]

Use the rollout's temperature, so the trainer and the engine describe the same tempered policy. Top-k /
top-p truncation is deliberately *not* re-applied: the trainer optimises the full distribution, and the
engine's truncation (which only removes mass, so π'(x) ≥ π(x) on its support) shows up in the importance
ratio π/π' that `rlbus.rl.correction` truncates or masks.
"""

from __future__ import annotations

import torch


def sampled_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log π(tokens) [B, T] from logits [B, T, V] aligned so that logits[:, t] predicts tokens[:, t].

    For a trainer forward over ``seq[:, :-1]`` pass ``tokens = seq[:, 1:]``. Computed in float32 with
    log-softmax, so it stays differentiable and exact for tokens of tiny probability.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (a greedy rollout has no stochastic policy to correct)")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, T, V]
    return logp.gather(-1, tokens.long()[..., None]).squeeze(-1)  # [B, T]
