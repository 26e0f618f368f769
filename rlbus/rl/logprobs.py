"""The trainer's log-probs of sampled tokens, to compare with the engine's behaviour log-probs.

For logits z_t (the model's output at position t, which predicts token x_{t+1}) and temperature τ:

    log π(x_{t+1}) = log softmax(z_t / τ)[x_{t+1}]

Use the rollout's temperature, so the trainer and the engine describe the same tempered policy. Where the
engine sampled under a grammar (constrained decoding), it masked the logits to the allowed tokens A_t before
temperature, and so does the trainer, with the same recorded masks:

    log π(x_{t+1}) = log softmax(z_t / τ  with  z_{t,y} = −inf for y ∉ A_t)[x_{t+1}]

so on-policy the ratio is exactly 1 at constrained tokens too (the mask is part of the sampling policy,
like the temperature; `rlbus.engines.constraints`). Top-k /
top-p truncation is deliberately *not* re-applied: the trainer optimises the full distribution, and the
engine's truncation (which only removes mass, so π'(x) ≥ π(x) on its support) shows up in the importance
ratio π/π' that `rlbus.rl.correction` truncates or masks.

The trainer never builds the [B, T, V] logits: `chunked_token_logprobs` takes the final hidden states h_t
(z_t = h_t · Wᵀ for the LM head W [V, D]) and computes the same quantity a chunk of positions at a time,
recomputing each chunk's logits in backward, so memory for the vocabulary projection is
O(chunk · V) instead of O(B · T · V) (V is 49 k for SmolLM2, 150 k for Qwen).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rlbus.engines.constraints import apply_masks


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


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
    allowed_index: torch.Tensor | None = None,
    allowed_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """log π(targets) [B, S] straight from final hidden states [B, S, D] and the LM head ``weight`` [V, D].

    Row b uses temperature ``temperature[b]``. Only the M positions where ``mask`` [B, S] is True are
    scored (0 elsewhere): they are gathered to [M, D] and projected ``chunk_tokens`` rows at a time, each
    chunk under activation checkpointing, so at most one [chunk_tokens, V] logits block exists at a time,
    in forward and in backward (which recomputes it), and none is kept between them. The projection runs
    in the inputs' (or the ambient autocast's) precision, the log-softmax in float32, exactly as
    `sampled_token_logprobs` on ``(hidden @ weight.T)`` would. Differentiable in ``hidden`` and ``weight``.

    ``allowed_index`` [B, S] (−1: unconstrained) names the row of ``allowed_bits`` [M, W] (int32 masks) that a
    constrained position's logits are masked with before the log-softmax (module docstring).
    """
    B, S, D = hidden.shape
    if tuple(targets.shape) != (B, S) or tuple(temperature.shape) != (B,) or weight.shape[-1] != D:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)} and "
            f"temperature {tuple(temperature.shape)} do not line up as [B, S, D], [V, D], [B, S], [B]"
        )
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    if bool((temperature <= 0).any()):
        raise ValueError("temperature must be > 0 (a greedy rollout has no stochastic policy to correct)")
    keep = torch.ones(B, S, dtype=torch.bool, device=hidden.device) if mask is None else mask.bool()
    where = keep.reshape(-1).nonzero().squeeze(-1)  # [M] flat positions to score
    h = hidden.reshape(B * S, D)[where]  # [M, D]
    t = targets.reshape(B * S)[where].long()  # [M]
    tau = temperature.float()[:, None].expand(B, S).reshape(B * S)[where]  # [M]
    constrained = None if allowed_index is None or allowed_bits is None else allowed_index.reshape(-1)[where]  # [M]
    if where.numel() == 0:  # nothing to score: zeros that still hang off the graph, so backward works
        return 0.0 * hidden.sum(-1).float()  # [B, S]
    pieces = []  # each [≤ chunk_tokens]
    for a in range(0, where.numel(), chunk_tokens):
        args: tuple[torch.Tensor, ...] = (h[a : a + chunk_tokens], weight, t[a : a + chunk_tokens],
                                          tau[a : a + chunk_tokens])
        index = None if constrained is None else constrained[a : a + chunk_tokens]  # [c]
        if index is not None and allowed_bits is not None and bool((index >= 0).any()):
            args = (*args, index, allowed_bits)
        grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args))
    flat = torch.zeros(B * S, device=hidden.device)  # [B*S]
    return flat.index_copy(0, where, torch.cat(pieces)).view(B, S)  # [B, S]


def _chunk_logprobs(
    h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, tau: torch.Tensor,
    index: torch.Tensor | None = None, bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """log softmax((h @ weight.T) / τ)[t] for one chunk: h [c, D], t [c], τ [c] → [c] (float32); positions
    whose ``index`` [c] is ≥ 0 have their logits masked with ``bits[index]`` first."""
    z = (h @ weight.T).float()  # [c, V]
    if index is not None and bits is not None:
        rows = (index >= 0).nonzero().squeeze(-1)  # [C]
        z = apply_masks(z, rows, bits[index[rows]])  # [c, V], −inf outside the allowed tokens
    z = z / tau[:, None]  # [c, V]
    return z.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)  # [c]
