"""The rlbus policy: a decoder-only transformer with an optional mixture-of-experts feed-forward.

One file, read top to bottom: config, RMSNorm, RoPE, attention with a KV cache, the dense and the MoE
feed-forward, the block, the model. It is small enough for CPU demos and tests (`PolicyConfig.tiny()`,
~1M parameters) and scales to a ~100M-parameter MoE for benchmarks (`PolicyConfig.bench()`).

Architecture (per block, pre-norm):   x ← x + Attn(RMSNorm(x));   x ← x + FFN(RMSNorm(x))
  * attention: multi-head, rotary position embedding (RoPE, rotate-half convention) on q and k;
  * FFN: SwiGLU MLP  w2(silu(w1 x) ⊙ w3 x); with ``n_experts > 0`` every block's FFN is an MoE of such MLPs.

Mixture of experts. For a token with hidden state x, router logits z = W_r x ∈ R^E. The experts used are
S = top-k(z) (or, under router replay, the experts given by the caller), and

    FFN(x) = Σ_{e ∈ S} g_e · MLP_e(x),      g_e = exp(z_e) / Σ_{j ∈ S} exp(z_j)

i.e. the gate weights are the router softmax renormalised over the chosen experts. Gates always come from
the model's *own* router logits, so under replay the router still receives gradient for the replayed
experts. Load balancing uses the Switch Transformer loss (Fedus et al. 2021, eq. 4), per MoE layer

    aux = E · Σ_e f_e · P_e,   f_e = (1 / (N·k)) · #{(token, slot) dispatched to e},   P_e = mean_token softmax(z)_e

over the N real tokens of the call (``key_mask`` excludes padding). f is a count (no gradient); the
gradient flows through P. Perfect balance gives aux = 1. The returned ``aux_loss`` is
``aux_loss_coef · mean over layers of aux``; under replay f counts the replayed (actually used) experts.

Router replay. ``forward(routed_experts=...)`` takes [L, B, T, k] expert ids (as recorded by the inference
engine) and dispatches tokens to those experts instead of its own top-k. It still returns its own top-k in
``LMOutput.routed_experts``, so the caller can measure the router-flip rate while replay is on.

KV cache. `KVCache` preallocates per-layer k/v tensors [B, H, max_len, D] and a slot offset ``pos``.
A forward call writes its T new keys/values at slots [pos, pos + T) and attends over slots [0, pos + T)
with a causal mask by slot; ``key_mask`` [B, pos + T] masks padding slots, and ``positions`` [B, T] gives
each row's own RoPE positions, so left-padded rows behave exactly like unpadded ones. Every query may
always attend to its own slot, which keeps rows made only of padding finite (their outputs are unused).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from rlbus.models.base import Features, LMOutput
from rlbus.models.config import PolicyConfig

__all__ = ["KVCache", "Policy", "PolicyConfig"]

# ----------------------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    """x / rms(x) · w, computed in float32 (bf16 squares lose too much)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, head_dim/2] for per-row positions [B, T].

    Computed from the positions on the fly instead of a precomputed table: positions can be anything
    (left padding, a continuing cache), there is no table to index out of bounds, and at these sizes the
    cost is negligible next to the matmuls.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    return angles.cos()[:, None], angles.sin()[:, None]  # [B, 1, T, D/2] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by the position angle (the Llama "rotate half" layout)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()  # [B, H, T, D/2] each
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # [B, H, T, D]
    return out.to(x.dtype)


@dataclass
class KVCache:
    """Preallocated keys/values of every layer plus the number of filled slots.

    All rows advance together (one slot per decode step), which is what left padding buys: the offset is a
    single int, and padding is handled by the key mask rather than by ragged per-row offsets.
    """

    k: list[torch.Tensor]
    """Per layer [B, H, max_len, D]."""
    v: list[torch.Tensor]
    """Per layer [B, H, max_len, D]."""
    pos: int = 0
    """Slots filled so far; the next call writes at [pos, pos + T)."""

    @classmethod
    def empty(
        cls, config: PolicyConfig, batch: int, max_len: int, *, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (batch, config.n_head, max_len, config.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        return cls(k=k, v=v, pos=0)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class Attention(nn.Module):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # [B, T, C] each
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            start = cache.pos
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k = cache.k[layer][:, :, : start + T]  # [B, H, S, D]
            v = cache.v[layer][:, :, : start + T]  # [B, H, S, D]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
        return self.proj(y)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) ⊙ w3 x)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with softmax-renormalised gates and the Switch balancing loss."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config.d_model, config.d_ff) for _ in range(config.n_experts))

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None, replay: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (output [B, T, C], own top-k experts [B, T, k], Switch aux loss scalar without coef)."""
        B, T, C = x.shape
        N, E, k = B * T, self.n_experts, self.top_k
        xf = x.reshape(N, C)  # [N, C]
        logits = self.router(xf).float()  # [N, E]
        own = logits.topk(k, dim=-1).indices  # [N, k]
        chosen = own if replay is None else replay.reshape(N, k).long()  # [N, k]
        gates = F.softmax(logits.gather(1, chosen), dim=-1)  # [N, k] renormalised over the chosen experts

        out = torch.zeros_like(xf)  # [N, C]
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(chosen == e)  # tokens routed to e, and which of their k slots
            if tok.numel() == 0:
                continue
            y = expert(xf[tok]) * gates[tok, slot, None].to(xf.dtype)  # [n_e, C]
            out.index_add_(0, tok, y)

        w = torch.ones(N, device=x.device) if token_mask is None else token_mask.reshape(N).float()  # [N]
        n_tok = w.sum().clamp(min=1.0)
        dispatched = F.one_hot(chosen, E).sum(1).float()  # [N, E] slots of each token sent to e
        f = (dispatched * w[:, None]).sum(0) / (n_tok * k)  # [E] fraction of dispatched slots
        p = (F.softmax(logits, dim=-1) * w[:, None]).sum(0) / n_tok  # [E] mean router probability
        aux = E * (f * p).sum()
        return out.view(B, T, C), own.view(B, T, k), aux


class Block(nn.Module):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        self.ffn: MLP | MoE = MoE(config) if config.moe else MLP(config.d_model, config.d_ff)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
        token_mask: torch.Tensor | None,
        replay: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = x + self.attn(self.norm1(x), cos, sin, mask, cache, layer)
        if isinstance(self.ffn, MoE):
            h, experts, aux = self.ffn(self.norm2(x), token_mask, replay)
            return x + h, experts, aux
        return x + self.ffn(self.norm2(x)), None, None


# ----------------------------------------------------------------------------------------------------------
# the model


class Policy(nn.Module):
    """Decoder-only transformer; implements `rlbus.models.base.CausalLM` and `TrainableLM`."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        self._checkpointing = False
        self.apply(self._init_weights)
        # GPT-2: scale the residual-writing projections so the residual stream's variance does not grow
        # with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(self.config, batch, max_len, device=self.device, dtype=self.wte.weight.dtype)

    def forward(
        self,
        idx: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: Any = None,
        routed_experts: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> LMOutput:
        """Logits for the new ids ``idx`` [B, T].

        ``positions`` [B, T] default to ``cache.pos + arange(T)``; ``key_mask`` [B, S] (S = cached + T) is
        True at real tokens; ``cache`` is a `KVCache` updated in place; ``routed_experts`` [L, B, T, k]
        replays recorded routing (see the module docstring).
        """
        B, T = idx.shape
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        start = 0 if cache is None else cache.pos
        S = start + T
        if cache is not None and S > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} slots; this call needs {S}")
        if key_mask is not None and tuple(key_mask.shape) != (B, S):
            raise ValueError(f"key_mask must be [B, S] = {(B, S)}, got {tuple(key_mask.shape)}")
        if routed_experts is not None:
            self._check_replay(routed_experts, B, T)
        if positions is None:
            positions = torch.arange(start, S, device=idx.device).expand(B, T)  # [B, T]

        mask: torch.Tensor | None = None
        if key_mask is not None or start > 0:
            q_slot = torch.arange(start, S, device=idx.device)[:, None]  # [T, 1]
            k_slot = torch.arange(S, device=idx.device)[None, :]  # [1, S]
            allowed = (k_slot <= q_slot).expand(B, T, S)  # [B, T, S] causal by slot
            if key_mask is not None:
                allowed = allowed & key_mask[:, None, :].bool()  # [B, T, S]
            allowed = allowed | (k_slot == q_slot)  # every query sees itself: no all-masked rows
            mask = allowed[:, None]  # [B, 1, T, S]
        token_mask = None if key_mask is None else key_mask[:, start:].bool()  # [B, T]

        x, own, aux = self._trunk(idx, positions, mask, cache, token_mask, routed_experts)
        if cache is not None:
            cache.pos = S
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x).float()  # [B, T or logits_to_keep, V]
        if own is None:
            return LMOutput(logits=logits, cache=cache, routed_experts=None, aux_loss=None)
        return LMOutput(logits=logits, cache=cache, routed_experts=own, aux_loss=aux)

    def features(
        self, idx: torch.Tensor, *, key_mask: torch.Tensor | None = None, routed_experts: torch.Tensor | None = None
    ) -> Features:
        """Final hidden states of an uncached forward (`rlbus.models.base.TrainableLM`)."""
        B, T = idx.shape
        if key_mask is not None and tuple(key_mask.shape) != (B, T):
            raise ValueError(f"key_mask must be [B, T] = {(B, T)}, got {tuple(key_mask.shape)}")
        if routed_experts is not None:
            self._check_replay(routed_experts, B, T)
        positions = torch.arange(T, device=idx.device).expand(B, T)
        mask = None
        token_mask = None
        if key_mask is not None:
            slot = torch.arange(T, device=idx.device)
            allowed = (slot[None, :] <= slot[:, None]).expand(B, T, T) & key_mask[:, None, :].bool()
            mask = (allowed | torch.eye(T, dtype=torch.bool, device=idx.device))[:, None]  # [B, 1, T, T]
            token_mask = key_mask.bool()
        x, own, aux = self._trunk(idx, positions, mask, None, token_mask, routed_experts)
        return Features(hidden=x, routed_experts=own, aux_loss=aux)

    def _trunk(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        token_mask: torch.Tensor | None,
        routed_experts: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(final-normed hidden [B, T, C], own experts [L, B, T, k] | None, aux loss | None)."""
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)  # [B, 1, T, D/2] each
        x = self.wte(idx)  # [B, T, C]
        own: list[torch.Tensor] = []
        aux: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            replay = None if routed_experts is None else routed_experts[i]  # [B, T, k]
            if self._checkpointing and self.training and cache is None:
                x, experts, layer_aux = torch.utils.checkpoint.checkpoint(
                    block, x, cos, sin, mask, cache, i, token_mask, replay, use_reentrant=False
                )
            else:
                x, experts, layer_aux = block(x, cos, sin, mask, cache, i, token_mask, replay)
            if experts is not None and layer_aux is not None:
                own.append(experts)
                aux.append(layer_aux)
        x = self.norm_f(x)
        if not own:
            return x, None, None
        return x, torch.stack(own), cfg.aux_loss_coef * torch.stack(aux).mean()

    @property
    def is_moe(self) -> bool:
        return self.config.moe

    def output_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        self._checkpointing = enabled

    def describe(self) -> dict[str, Any]:
        """``{"kind": "policy", "shape": PolicyConfig fields}``: the architecture, no weights."""
        return {"kind": "policy", "shape": dataclasses.asdict(self.config)}

    def _check_replay(self, routed: torch.Tensor, B: int, T: int) -> None:
        cfg = self.config
        if not cfg.moe:
            raise ValueError("routed_experts given but the policy is dense (n_experts = 0)")
        expected = (cfg.n_layer, B, T, cfg.top_k)
        if tuple(routed.shape) != expected:
            raise ValueError(f"routed_experts must be [L, B, T, k] = {expected}, got {tuple(routed.shape)}")
        if routed.numel() and (int(routed.min()) < 0 or int(routed.max()) >= cfg.n_experts):
            raise ValueError(f"routed_experts ids must be in [0, {cfg.n_experts})")
