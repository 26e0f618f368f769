"""The torch engine's static path: a preallocated KV arena and a decode step with fixed shapes.

For the dense Llama-family models rlbus serves (Llama, SmolLM2, Qwen2/2.5, Qwen3, Mistral without a sliding
window) the engine runs its own forward over the model's own modules — projections, norms, rotary embedding,
MLPs, read live, so in-place swaps and re-pointed weights apply — with attention over a KV *arena*:

    k[l], v[l]  [R, H_kv, C, D]   R = max_batch row slots, C columns, written in place
    key_mask    [R, C]            True at a row's real columns; never grown by concatenation

Layout. Rows occupy slots [0, n). They share one column offset ``pos`` and are right-aligned: row i's real
columns are [pos - lens[i], pos), so one decode step writes column ``pos`` for every row and the offset is a
single number (the same trade as the dynamic path, `rlbus.engines.torch_engine`). Newcomers are prefilled
straight into free slots, ending at ``pos``; a newcomer longer than ``pos`` moves the running rows right
first, and when ``pos`` plus what the rows may still write passes C the leading columns no row uses are
dropped (or, failing that, the arena grows). Retired rows are filled by rows from the end (a few rows
copied, not the arena). All of this happens between steps, on host-known numbers.

The decode step (`StaticBatch.step`) feeds every row its newest token and samples the next one
(`rlbus.engines.sampling.draw`) with tensor ops only: the per-row sampling parameters, positions, last tokens
and seeds' counters live on the device and are advanced there, and the step ends by writing (token, log π')
per row into one small buffer — the host copies that once (`StaticBatch.read`). Nothing in the step depends
on a host value that changes from step to step except the write column, which the graph form reads from a
device tensor. On CUDA the step is captured once per (batch-size bucket, truncation, arena) into a
``torch.cuda.CUDAGraph`` (`rlbus.engines.graphs`) and replayed: the whole step is one launch. The graph form
attends over all C columns (masked), the eager form over the columns in use; both compute the same thing.

MoE models, sliding-window attention and dynamic RoPE scaling stay on the dynamic path (`static_support`
says why a model does not qualify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlbus.engines.sampling import SamplingParams, draw

#: transformers model types whose decoder layers this forward reproduces.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
#: RoPE types whose frequencies are fixed (no per-call update, which would read positions on the host).
FIXED_ROPE = ("default", "linear", "llama3", "yarn")


def static_support(model: Any) -> str | None:
    """None when ``model`` can run on the static path; otherwise why not."""
    hf = getattr(model, "hf", None)
    if hf is None:
        return f"{type(model).__name__} is not a transformers model"
    if getattr(model, "router", None) is not None:
        return "a mixture of experts routes tokens on the host"
    config = hf.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    inner = getattr(hf, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the decoder does not have the Llama layout"
    if getattr(inner.rotary_emb, "rope_type", "default") not in FIXED_ROPE:
        return f"RoPE type {inner.rotary_emb.rope_type!r} updates its frequencies per call"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention"
    for layer in inner.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
        if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return "an attention layer without q/k/v/o projections"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


class LlamaFamily:
    """The forward of a dense Llama-family ``transformers`` model over a KV arena (its own modules, read live).

    ``write`` is where the new keys/values go: a column slice (prefill, eager decode) or a [1] long tensor
    holding the column (the graph form: ``index_copy_``). ``window`` is the columns attended over, ``mask``
    [n, 1, T, W] bool their visibility (True = attend)."""

    def __init__(self, model: Any) -> None:
        reason = static_support(model)
        if reason is not None:
            raise ValueError(f"no static path for this model: {reason}")
        self.hf = model.hf
        self.decoder = model.hf.model
        config = model.hf.config
        self.n_layer = len(self.decoder.layers)
        self.n_kv = int(config.num_key_value_heads)
        self.n_head = int(config.num_attention_heads)
        self.head_dim = int(self.decoder.layers[0].self_attn.head_dim)
        self.vocab = int(config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def weights_signature(self) -> tuple[int, ...]:
        """The addresses of every parameter: a captured graph is valid while they are unchanged (weight sync
        may re-point parameters at a spare buffer)."""
        return tuple(p.data_ptr() for p in self.hf.parameters())

    def forward(
        self,
        arena: Arena,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: slice,
        window: slice,
        write: slice | torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [n, V] (float32) of the last of the new ids [n, T] of arena rows ``rows``."""
        n, T = ids.shape
        h = self.decoder.embed_tokens(ids)  # [n, T, C]
        cos, sin = self.decoder.rotary_emb(h, positions)  # [n, T, D] each, in the model's dtype
        cos, sin = cos[:, None], sin[:, None]  # [n, 1, T, D]
        for layer_k, layer_v, layer in zip(arena.k, arena.v, self.decoder.layers, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n, T, -1, self.head_dim)  # [n, T, H, D]
            k = attn.k_proj(x).view(n, T, -1, self.head_dim)  # [n, T, H_kv, D]
            v = attn.v_proj(x).view(n, T, -1, self.head_dim).transpose(1, 2)  # [n, H_kv, T, D]
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [n, H, T, D], [n, H_kv, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if isinstance(write, slice):
                layer_k[rows, :, write] = k
                layer_v[rows, :, write] = v
            else:
                layer_k[rows].index_copy_(2, write, k)
                layer_v[rows].index_copy_(2, write, v)
            o = _attend(q, layer_k[rows, :, window], layer_v[rows, :, window], mask, attn.scaling)  # [n, H, T, D]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(n, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = self.decoder.norm(h[:, -1:])  # [n, 1, C]
        return self.hf.lm_head(last)[:, 0].float()  # [n, V]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of q [n, H, T, D] over k, v [n, H_kv, W, D] (grouped heads) with a bool mask [n, 1, T, W]."""
    n, H, T, D = q.shape
    rep = H // k.shape[1]
    if rep > 1 and T == 1:  # one query: the group's heads stand in for query positions (no repeated keys)
        o = F.scaled_dot_product_attention(q.reshape(n, H // rep, rep, D), k, v, attn_mask=mask, scale=scale)
        return o.reshape(n, H, 1, D)
    if rep > 1:
        k = k[:, :, None].expand(n, k.shape[1], rep, *k.shape[2:]).reshape(n, H, *k.shape[2:])
        v = v[:, :, None].expand(n, v.shape[1], rep, *v.shape[2:]).reshape(n, H, *v.shape[2:])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@dataclass
class Arena:
    """The preallocated keys/values and key mask (see the module docstring)."""

    k: list[torch.Tensor]  # per layer [R, H_kv, C, D]
    v: list[torch.Tensor]  # per layer [R, H_kv, C, D]
    key_mask: torch.Tensor  # [R, C] bool

    @classmethod
    def empty(cls, fwd: LlamaFamily, rows: int, cols: int) -> Arena:
        shape = (rows, fwd.n_kv, cols, fwd.head_dim)
        kw: dict[str, Any] = {"device": fwd.device, "dtype": fwd.dtype}
        return cls(k=[torch.zeros(shape, **kw) for _ in range(fwd.n_layer)],
                   v=[torch.zeros(shape, **kw) for _ in range(fwd.n_layer)],
                   key_mask=torch.zeros(rows, cols, dtype=torch.bool, device=fwd.device))  # fmt: skip

    @property
    def cols(self) -> int:
        return int(self.key_mask.shape[1])


class StaticBatch:
    """The rows in flight on the static path: the arena, each row's device state, and the host's view of it
    (``n`` rows, column offset ``pos``, each row's real column count ``lens``)."""

    def __init__(self, fwd: LlamaFamily, rows: int, max_cols: int) -> None:
        self.fwd = fwd
        self.rows = rows
        self.max_cols = max_cols
        device = fwd.device
        self.arena = Arena.empty(fwd, rows, 0)
        self.generation = 0  # bumped whenever the arena is reallocated (captured graphs then go)
        self.shifts = 0  # times the rows' columns moved (a longer newcomer, or compaction)
        self.n = 0
        self.pos = 0
        self.lens: list[int] = []
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # [R] token each row feeds next
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)  # [R] its RoPE position
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # [1] the write column (graph form)
        self.params = SamplingParams(
            temperature=torch.ones(rows, device=device), top_k=torch.zeros(rows, dtype=torch.long, device=device),
            top_p=torch.ones(rows, device=device), seed=torch.zeros(rows, dtype=torch.long, device=device),
            counter=torch.zeros(rows, dtype=torch.long, device=device), truncate=False,
        )  # fmt: skip
        self.out = torch.zeros(2, rows, dtype=torch.float64, device=device)  # [2, R] (token, log π') per row
        self.logp: torch.Tensor | None = None  # [b, V] log π' of the last step (top log-probs)

    # -- columns --------------------------------------------------------------------------------------

    def make_room(self, end: int, remaining: int) -> None:
        """Make ``pos`` >= ``end`` with ``remaining`` free columns after it, keeping every row's columns."""
        if self.n == 0:
            self.pos = 0
            self.lens = []
            self.arena.key_mask.zero_()
        if max(self.pos, end) + remaining > self.arena.cols and self.n:
            self._shift(-(self.pos - max(self.lens)))  # drop the leading columns no row uses
        if max(self.pos, end) + remaining > self.arena.cols:
            self._grow(max(self.pos, end) + remaining)
        if end > self.pos:
            self._shift(end - self.pos)

    def _shift(self, d: int) -> None:
        """Move rows [0, n)'s columns by ``d`` (right if positive)."""
        if d == 0:
            return
        self.shifts += 1
        lo, n = self.pos - max(self.lens, default=0), self.n
        for layer in (*self.arena.k, *self.arena.v):
            layer[:n, :, lo + d : self.pos + d] = layer[:n, :, lo : self.pos].clone()
        mask = self.arena.key_mask
        moved = mask[:n, lo : self.pos].clone()
        mask[:n] = False
        mask[:n, lo + d : self.pos + d] = moved
        self.pos += d

    def _grow(self, needed: int) -> None:
        cols = min(max(2 * self.arena.cols, -(-needed // 64) * 64), max(self.max_cols, needed))
        old, n, pos = self.arena, self.n, self.pos
        self.arena = Arena.empty(self.fwd, self.rows, cols)
        for new, prev in zip((*self.arena.k, *self.arena.v), (*old.k, *old.v), strict=True):
            new[:n, :, :pos] = prev[:n, :, :pos]
        self.arena.key_mask[:n, :pos] = old.key_mask[:n, :pos]
        self.generation += 1

    # -- rows -----------------------------------------------------------------------------------------

    def prefill(
        self, ids: torch.Tensor, valid: torch.Tensor, lens: list[int], params: SamplingParams, *,
        cached: list[Any] | None = None, cached_len: int = 0, allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Newcomers into slots [n, n + g): ids [g, T] (left padded, ``valid`` [g, W] over the window of
        their columns, ``lens`` their real column counts) end at ``pos``; a cached row (g = 1) starts from
        ``cached`` (per layer [1, H, m, D] keys and values of its first ``cached_len`` tokens). Samples each
        row's first token (``allowed`` [g, V]: the constrained-decoding mask, `rlbus.engines.sampling`):
        (tokens [g], log π'(token) [g], log π' [g, V]). Call `make_room` first."""
        g, T = ids.shape
        W = T + cached_len
        slots, window = slice(self.n, self.n + g), slice(self.pos - W, self.pos)
        mask = self.arena.key_mask
        mask[slots] = False
        mask[slots, window] = valid
        if cached is not None:
            c0 = self.pos - W
            for layer_k, layer_v, (k, v) in zip(self.arena.k, self.arena.v, cached, strict=True):
                layer_k[slots, :, c0 : c0 + cached_len] = k[:, :, :cached_len]
                layer_v[slots, :, c0 : c0 + cached_len] = v[:, :, :cached_len]
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)[:, cached_len:]  # [g, T]
        q_col = torch.arange(cached_len, W, device=ids.device)[:, None]  # [T, 1]
        k_col = torch.arange(W, device=ids.device)[None, :]  # [1, W]
        visible = ((k_col <= q_col) & valid[:, None, :]) | (k_col == q_col)  # [g, T, W] causal, own slot always
        logits = self.fwd.forward(self.arena, ids, positions, slots, window, slice(self.pos - T, self.pos),
                                  visible[:, None])  # fmt: skip
        tokens, token_logp, logp = draw(logits, params, allowed=allowed)
        self.last[slots] = tokens
        self.next_pos[slots] = positions[:, -1] + 1
        for name, t in params.tensors().items():
            getattr(self.params, name)[slots] = t
        self.lens += lens
        self.n += g
        return tokens, token_logp, logp

    def retire(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep`` (ascending): slots below len(keep) that retire are filled by the kept rows past
        it, so only those rows move. Returns the new order: new slot s holds old row ``order[s]``."""
        m, kept = len(keep), set(keep)
        holes = [s for s in range(m) if s not in kept]
        movers = [i for i in keep if i >= m]
        if holes:
            dst = torch.tensor(holes, device=self.last.device)
            src = torch.tensor(movers, device=self.last.device)
            for t in (*self.arena.k, *self.arena.v, self.arena.key_mask, self.last, self.next_pos,
                      *self.params.tensors().values()):  # fmt: skip
                t[dst] = t[src]
        filled = dict(zip(holes, movers, strict=True))
        order = [filled.get(s, s) for s in range(m)]
        self.lens = [self.lens[i] for i in order]
        self.n = m
        if m == 0:
            self.pos = 0
        return order

    def row_slots(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row i's keys/values at its real columns, per layer ([1, H_kv, lens[i], D] × 2), as copies."""
        cols = slice(self.pos - self.lens[i], self.pos)
        return [(k[i : i + 1, :, cols].clone(), v[i : i + 1, :, cols].clone())
                for k, v in zip(self.arena.k, self.arena.v, strict=True)]  # fmt: skip

    # -- the decode step ------------------------------------------------------------------------------

    def step(self, b: int, *, graph: bool, truncate: bool, allowed: torch.Tensor | None = None) -> None:
        """One decode step of rows [0, b) on the device (b >= n; rows past n are idle slots). ``graph``: the
        capturable form (write column from ``self.col``, every column attended). Writes ``self.out``."""
        rows = slice(0, b)
        mask = self.arena.key_mask
        if graph:
            mask[rows].index_fill_(1, self.col, True)
            window: slice = slice(0, self.arena.cols)
            write: slice | torch.Tensor = self.col
        else:
            mask[rows, self.pos] = True
            window = slice(self.pos - max(self.lens), self.pos + 1)
            write = slice(self.pos, self.pos + 1)
        logits = self.fwd.forward(self.arena, self.last[rows, None], self.next_pos[rows, None], rows, window, write,
                                  mask[rows, None, None, window])  # fmt: skip
        params = SamplingParams(**{k: v[rows] for k, v in self.params.tensors().items()}, truncate=truncate)
        tokens, token_logp, self.logp = draw(logits, params, allowed=allowed)
        self.last[rows] = tokens
        self.next_pos[rows] += 1
        self.out[0, rows] = tokens.double()
        self.out[1, rows] = token_logp.double()

    def advanced(self) -> None:
        """Host bookkeeping after a step: every row fed one token at column ``pos``."""
        self.pos += 1
        self.lens = [n + 1 for n in self.lens]

    def read(self) -> tuple[list[int], list[float]]:
        """The step's (token, log π') of rows [0, n): the step's one device→host copy."""
        tokens, logps = self.out[:, : self.n].tolist()
        return [int(t) for t in tokens], logps
