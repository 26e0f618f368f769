"""The sampling distribution of the torch engine, as pure functions.

Given next-token logits z ∈ R^V and a request's (temperature τ, top-k k, top-p p), the token is drawn from

    s      = z / τ                                        (τ = 0: greedy, see below)
    K      = the k largest entries of s                   (k = 0: all V)
    N      = smallest prefix of K, by decreasing s, whose softmax mass over K reaches p   (p = 1: all of K)
    π'(x)  = exp(s_x) / Σ_{y ∈ N} exp(s_y)  for x ∈ N,   0 otherwise

which is vLLM's order (temperature, then top-k, then top-p on the top-k renormalised probabilities).
``processed_logprobs`` returns log π' (−inf outside N); the engine reports log π'(sampled token), so the
behaviour log-probs describe the distribution the token really came from. Greedy (τ = 0) is the point
mass on the argmax: log π' = 0 there and −inf elsewhere.

Sampling uses the exponential-race trick: argmax_x π'(x) / E_x with E_x ~ Exp(1) i.i.d. is distributed as
π' — one vectorised draw per row from that row's `torch.Generator`, so a request with its own seed gets
the same random stream whatever batch it is in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """log π' [B, V] for logits [B, V] and per-row temperature [B], top_k [B] (0 = off), top_p [B]."""
    V = logits.shape[-1]
    greedy = temperature <= 0  # [B]
    tau = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [B]
    scaled = logits.float() / tau[:, None]  # [B, V]
    if not bool((greedy | (top_k > 0) | (top_p < 1)).any()):  # nothing truncated: π' = softmax(s), no sort
        return torch.log_softmax(scaled, dim=-1)  # [B, V]
    sorted_s, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    rank = torch.arange(V, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))  # [B]
    keep = rank < k[:, None]  # [B, V] top-k, in sorted order
    probs = torch.softmax(sorted_s.masked_fill(~keep, float("-inf")), dim=-1)  # [B, V] renormalised over K
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly more likely tokens
    # nucleus; rank 0 always kept. top_p = 1 keeps everything: the float cumsum can reach 1 before the last
    # tokens of a 49 k vocabulary, and "mass before < 1" would then cut a tail that was never meant to go.
    nucleus = (mass_before < top_p.float()[:, None]) | (top_p >= 1)[:, None]
    keep = keep & nucleus  # [B, V]
    keep = torch.where(greedy[:, None], rank == 0, keep)  # [B, V]
    keep_vocab = torch.zeros_like(keep).scatter(1, order, keep)  # [B, V] back to vocabulary order
    return torch.log_softmax(scaled.masked_fill(~keep_vocab, float("-inf")), dim=-1)  # [B, V]


def sample(logprobs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Draw one token per row of log π' [B, V], row i using ``generators[i]``; returns ids [B]."""
    B, V = logprobs.shape
    if len(generators) != B:
        raise ValueError(f"need one generator per row: {B} rows, {len(generators)} generators")
    noise = torch.stack(
        [torch.empty(V, device=logprobs.device).exponential_(generator=g) for g in generators]
    )  # [B, V] i.i.d. Exp(1)
    # In log space (argmax log π' − log E) so tiny probabilities do not underflow to zero; a zero draw
    # is clamped so that an impossible token (log π' = −inf) can never win.
    noise = noise.clamp_min(torch.finfo(noise.dtype).tiny)
    return (logprobs - noise.log()).argmax(dim=-1)  # [B]
