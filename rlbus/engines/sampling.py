"""The sampling distribution of the torch engine and its sampler, as batched tensor ops with no host sync.

Given next-token logits z ∈ R^V and a request's (temperature τ, top-k k, top-p p), the token is drawn from

    s      = z / τ                                        (τ = 0: greedy, see below)
    K      = the k largest entries of s                   (k = 0: all V)
    N      = smallest prefix of K, by decreasing s, whose softmax mass over K reaches p   (p = 1: all of K)
    π'(x)  = exp(s_x) / Σ_{y ∈ N} exp(s_y)  for x ∈ N,   0 otherwise

which is vLLM's order (temperature, then top-k, then top-p on the top-k renormalised probabilities).
``processed_logprobs`` returns log π' (−inf outside N); the engine reports log π'(sampled token), so the
behaviour log-probs describe the distribution the token really came from. Greedy (τ = 0) is the point
mass on the argmax: log π' = 0 there and −inf elsewhere.

Per-row logits mask (the constrained-decoding hook). ``allowed`` [B, V] bool, True where a row may sample,
is applied to the logits *before* temperature, top-k and top-p: π' is then the distribution restricted to
the allowed tokens and renormalised, and the recorded log-probs stay exact for it. A batch in which no row
is constrained passes None and pays nothing; a constrained row next to unconstrained ones gets an all-True
row in the mask. A row whose mask allows nothing has no distribution: the caller must not build one.

Sampling is inverse-CDF with one counter-based uniform per row and step: u = H(key, counter), where the
key is a hash of the row's seed (`row_key`, once, on the host), the counter the number of tokens the row
has sampled so far and H a keyed integer hash (the counter-based
generator idea of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the mixing
function is the public-domain "lowbias32" integer hash of C. Wellons). The token is the first x whose
cumulative π' (in vocabulary order, summed in float64; a probability under float32's 1e-45 counts as 0)
exceeds u · Σπ'. A row's draws therefore depend only on its
own seed and its position, never on the batch it shares or on a generator object: a seeded request
samples the same tokens alone, in any batch, before or after a CUDA graph replay. Everything is tensor
ops over the batch ([B] hashes, one [B, V] cumsum and a searchsorted), so the step needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_M32 = 0xFFFFFFFF


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    truncate: bool | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """log π' [B, V] for logits [B, V] and per-row temperature [B], top_k [B] (0 = off), top_p [B].

    ``truncate`` says whether any row is greedy or truncates (top-k > 0 or top-p < 1); False skips the sort.
    The engine knows it from the requests; None reads it off the tensors (a host sync: for tests and tools).
    ``allowed`` [B, V] bool is the per-row logits mask (module docstring); None = every token allowed.
    """
    V = logits.shape[-1]
    if truncate is None:
        truncate = bool(((temperature <= 0) | (top_k > 0) | (top_p < 1)).any())
    greedy = temperature <= 0  # [B]
    tau = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [B]
    scaled = logits.float() / tau[:, None]  # [B, V]
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, float("-inf"))  # [B, V] the constraint comes first
    if not truncate:  # nothing truncated: π' = softmax(s), no sort
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


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x · c mod 2³² for x in [0, 2³²) (int64): c split in 16-bit halves, so no product leaves int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective avalanche hash of 32-bit words held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """`_mix32` on a Python int (the host side of a row's key)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int) -> int:
    """A request's seed (any Python int) as the 32-bit key its draws hash with (computed once, on the host)."""
    seed &= (1 << 64) - 1
    return _mix32_int((seed & _M32) ^ _mix32_int((seed >> 32) ^ 0x9E3779B9))


def counter_uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """u ∈ (0, 1) float64 [B] from row keys [B] (`row_key`, int64) and counters [B]: a pure function of each
    pair, 53 bits of it from two rounds of the hash."""
    a = _mix32((counters & _M32) ^ keys)
    b = _mix32(a ^ ((counters >> 32) & _M32) ^ 0x85EBCA6B)
    bits = (a << 21) | (b >> 11)  # 53 random bits
    return (bits.double() + 0.5) * 2.0**-53


def sample(logprobs: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One token per row of log π' [B, V], row i drawn with ``counter_uniform(keys[i], counters[i])``;
    ids [B]. A token outside the support (log π' = −inf) is never drawn."""
    u = counter_uniform(keys, counters)  # [B]
    cdf = torch.cumsum(logprobs.exp(), dim=-1, dtype=torch.float64)  # [B, V] summed in float64
    target = (u * cdf[:, -1])[:, None]  # [B, 1] strictly inside (0, Σπ')
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logprobs.shape[-1] - 1)  # [B]
    # u · Σ rounding up to Σ would land past the last supported token: take the row's mode instead
    outside = logprobs.gather(1, tokens[:, None]).squeeze(1) == float("-inf")
    return torch.where(outside, logprobs.argmax(dim=-1), tokens)


@dataclass
class SamplingParams:
    """Each row's sampling parameters on the device ([B] each), and whether any row truncates (host side,
    so the sampler's branch needs no sync). ``counter`` is the tokens each row has sampled so far."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64: each row's key (`row_key` of its seed)
    counter: torch.Tensor  # [B] int64
    truncate: bool

    @classmethod
    def of(cls, rows: list[tuple[float, int, float, int, int]], device: torch.device | str) -> SamplingParams:
        """From (temperature, top_k, top_p, key, counter) per row: one host→device copy."""
        floats = torch.tensor([(t, p) for t, _, p, _, _ in rows], dtype=torch.float32).reshape(-1, 2)  # [B, 2]
        ints = torch.tensor([(k, s, c) for _, k, _, s, c in rows], dtype=torch.int64).reshape(-1, 3)  # [B, 3]
        floats, ints = floats.to(device), ints.to(device)
        truncate = any(t <= 0 or k > 0 or p < 1 for t, k, p, _, _ in rows)
        return cls(temperature=floats[:, 0], top_k=ints[:, 0], top_p=floats[:, 1], seed=ints[:, 1],
                   counter=ints[:, 2].clone(), truncate=truncate)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed,
                "counter": self.counter}

    def select(self, rows: torch.Tensor, truncate: bool) -> SamplingParams:
        """Rows ``rows`` [B'] (long), in that order."""
        return SamplingParams(**{k: v[rows] for k, v in self.tensors().items()}, truncate=truncate)

    @staticmethod
    def cat(a: SamplingParams, b: SamplingParams) -> SamplingParams:
        joined: dict[str, Any] = {k: torch.cat([v, b.tensors()[k]]) for k, v in a.tensors().items()}
        return SamplingParams(**joined, truncate=a.truncate or b.truncate)


def draw(
    logits: torch.Tensor, params: SamplingParams, *, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of sampling for logits [B, V]: (tokens [B], log π'(token) [B], log π' [B, V]); advances
    ``params.counter`` in place. Tensor ops only: no host sync."""
    logp = processed_logprobs(logits, params.temperature, params.top_k, params.top_p, truncate=params.truncate,
                              allowed=allowed)  # [B, V]
    tokens = sample(logp, params.seed, params.counter)  # [B]
    params.counter.add_(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), logp


