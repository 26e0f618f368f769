"""Continuous batching in plain PyTorch: KV cache, processed log-probs, routed experts, in-flight swaps.

Layout: **left padding with one shared cache offset**. The rows in flight form one [B, S] block of cache
slots; each row is right-aligned (its real slots are its last ones), a key mask [B, S] marks real slots and
each row carries its own RoPE positions (0 at its first real token), so a row computes what it would
compute alone (up to float rounding). Right alignment puts every row's newest token in the last column,
so one decode step feeds [B, 1] and appends one slot to every row: the cache offset is a single int,
which both cache types (the in-house preallocated `KVCache` and transformers' `DynamicCache`) need, and
padding costs a mask, never a ragged index.

Continuous batching. At most ``max_batch`` rows are in flight; the rest wait in a FIFO queue that
`submit` (and so every concurrent `generate`) appends to. At every step boundary the engine

1. runs the boundary hooks (``between_steps``, then pending swaps) when a batch is in flight;
2. decodes one token for every row in flight;
3. retires finished rows: their results are delivered at once, their rows are dropped from the cache
   and so are the leading slots no remaining row uses (compaction — the only moment such slots can
   appear, so S never exceeds the longest context in flight);
4. fills free slots from the queue: the newcomers are prefilled as their own small left-padded batch,
   sample their first token, and are merged into the running batch — the shorter of the two caches is
   left padded with masked zero slots so both end at the same offset (`rlbus.engines.kv`).

A row's tokens, log-probs and experts therefore depend only on its own prompt, sampling parameters, seed
and the weights: greedy results equal running the request alone. ``continuous=False`` keeps the same
machinery but admits a new wave only when the batch is empty (static batching, the baseline).

Prefix cache (``prefix_cache_tokens`` > 0, `rlbus.engines.prefix`). A finished row's keys/values are kept;
a newcomer whose prompt extends a kept row under the same policy version starts from those slots and
prefills only the rest (its own one-row forward, then merged like any newcomer). An agent's next turn
then costs its new tokens, not its whole context. ``GenerationResult.extra["cached_prompt_tokens"]``
says how much of each prompt was reused; `prefix_stats` counts hits and tokens.

Driving. There is no engine thread: every thread waiting in `generate` (or `drive`) may run steps. One
at a time drives; it runs steps until its own requests are done, then hands over to a waiter whose
requests are still pending, so a short request joining a long one returns as soon as it finishes.

Per step: forward → the constraint hook (below) → `sampling.draw` (processed log-probs, then a
counter-based draw) → the grammar states consume their tokens → record (token, log π'(token), policy
version, experts). The log-prob is of the distribution actually sampled from (after
temperature and top-k/top-p truncation, renormalised); `GenerationResult.logprob_spec` says so. The policy
version of a token is the engine's ``policy_version`` when its distribution was computed. Each row samples
with its own seed (the request's, or one drawn from the engine's seed at `submit`) and its own token
counter (`rlbus.engines.sampling`), so a seeded request gets the same tokens in any batch.

Two paths, one behaviour. Dense Llama-family ``transformers`` models (SmolLM2, Qwen2.5, Llama, Qwen3) run
the *static path* (`rlbus.engines.static`): keys/values in a preallocated arena written in place, per-row
sampling state on the device, a decode step whose only host sync is the one copy of (token, log π') per
row, captured as a CUDA graph per batch-size bucket on a GPU (`rlbus.engines.graphs`). Every other model
(the in-house `Policy`, MoE models, other architectures) runs the *dynamic path* below: the model's own
cache object, re-aligned by `rlbus.engines.kv` between steps. Both share admission, prefix caching,
retirement, swaps and sampling, and give the same tokens for the same weights (up to float rounding).

Constrained decoding hook. `TorchEngine._allowed` returns a [B, V] bool mask of the tokens each row in
flight may sample next — a constrained row's grammar mask (`rlbus.engines.constraints`), all True for the
others — or None when no row is constrained (then nothing is paid); it is applied to the logits before
temperature, top-k and top-p (`rlbus.engines.sampling.processed_logprobs`), so recorded log-probs stay
exact for the constrained distribution (after the grammar's mask, temperature and top-k/top-p truncation,
renormalised). A batch with a mask decodes eagerly (no graph).

Weight swaps. Between decode steps (never before a batch's first prefill, never after its last step) the
engine runs its ``between_steps`` hook, then every swap pending on its `SwapPoint`; a swap submitted
between two steps runs at once. A swap writes into the live tensors of `state_dict()` in place and sets
``policy_version``; the following tokens carry the new version. Keys/values already in the cache were
computed by the old weights and are not recomputed — the usual in-flight update trade-off, visible to
the trainer through the per-token versions.

`generate` blocks; call it from a worker thread (``asyncio.to_thread``) so the event loop stays free.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlbus.engines import kv
from rlbus.engines.base import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LogprobSpec,
    SwapPoint,
    TokenDecoder,
)
from rlbus.engines.constraints import Grammars, RowConstraint, advance, mask_logits
from rlbus.engines.graphs import StepGraphs
from rlbus.engines.prefix import Prefix, PrefixCache
from rlbus.engines.sampling import SamplingParams, draw, row_key
from rlbus.engines.static import LlamaFamily, StaticBatch, static_support
from rlbus.models.base import CausalLM


@dataclass
class _Row:
    """Mutable per-request state from `submit` to its result."""

    request: GenerationRequest
    seed: int  # the sampler's key for this row (`rlbus.engines.sampling.row_key` of its seed)
    future: Future[GenerationResult]
    submitted: float
    admitted: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)  # [L, t, k] per forward that fed this row
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per step: (id, log π') most likely first
    finish: FinishReason | None = None
    text: str = ""
    cached: int = 0  # prompt tokens whose keys/values came from the prefix cache
    constraint: RowConstraint | None = None  # the grammar state of a constrained request

    @property
    def remaining(self) -> int:
        """Tokens it may still sample (each one a decode step after the first)."""
        return self.request.max_new_tokens - len(self.tokens)

    @property
    def sampling(self) -> tuple[float, int, float, int, int]:
        """(temperature, top_k, top_p, seed, tokens sampled): what `SamplingParams.of` takes."""
        r = self.request
        return (r.temperature, r.top_k, r.top_p, self.seed, len(self.tokens))

    @property
    def truncates(self) -> bool:
        r = self.request
        return r.temperature <= 0 or r.top_k > 0 or r.top_p < 1


@dataclass
class _Batch:
    """The rows in flight and their shared cache; every row has sampled ``last`` but not fed it yet."""

    rows: list[_Row]
    cache: Any
    key_mask: torch.Tensor  # [B, S] True at real slots; rows right-aligned
    next_pos: torch.Tensor  # [B] RoPE position of each row's next token
    last: torch.Tensor  # [B] each row's newest sampled token
    params: SamplingParams  # [B] each row's sampling parameters and counter, on the device


class TorchEngine:
    """`rlbus.engines.base.Engine` over any `CausalLM` (the in-repo `Policy` or an `HFCausalLM`)."""

    def __init__(
        self,
        model: CausalLM,
        *,
        tokenizer: TokenDecoder | None = None,
        seed: int = 0,
        pad_id: int = 0,
        policy_version: int = 0,
        between_steps: Callable[[], None] | None = None,
        swap_point: SwapPoint | None = None,
        max_batch: int = 32,
        continuous: bool = True,
        prefix_cache_tokens: int = 0,
        static: bool | None = None,
        cuda_graphs: bool | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``pad_id`` is fed at padding slots (any valid id: those slots are masked);
        ``between_steps`` runs between decode steps, before pending swaps; ``max_batch`` bounds the rows
        in flight; ``continuous=False`` refills only once the whole batch is done (static batching);
        ``prefix_cache_tokens`` > 0 keeps finished rows' keys/values, that many tokens in all, for prompts
        that extend them (0: off). ``static``: the static path (None: whenever the model qualifies, see
        `rlbus.engines.static.static_support`); ``cuda_graphs``: capture its decode step per batch-size
        bucket (None: on CUDA; on a CPU, True runs the capturable form uncaptured); ``grammars`` compiles
        requests' constraints (None: constrained requests are refused)."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.policy_version = policy_version
        self.between_steps = between_steps
        self.swap_point = swap_point if swap_point is not None else SwapPoint()
        self.max_batch = max_batch
        self.continuous = continuous
        self._seeds = random.Random(seed)  # seeds of requests that bring none, drawn at submit
        reason = static_support(model)
        if static and reason is not None:
            raise ValueError(f"static=True, but {reason}")
        self.static = reason is None if static is None else static
        self._fwd = LlamaFamily(model) if self.static else None
        on_cuda = model.device.type == "cuda"
        graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.graphs = StepGraphs(max_batch, capture=on_cuda) if self.static and graphs else None
        self._arena: StaticBatch | None = None  # the static path's rows in flight
        self._rows: list[_Row] = []  # the static path's rows, in arena slot order
        #: Admissions that joined a running batch (both paths).
        self.merges = 0
        self._cond = threading.Condition()
        self._waiting: deque[_Row] = deque()  # guarded by _cond
        self._driving = False  # guarded by _cond
        self._batch: _Batch | None = None  # touched only by the driving thread
        self._admitting: list[_Row] = []  # rows being prefilled (failed with the batch on an error)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.grammars = grammars

    @property
    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counters (all 0 when it is off) plus the tokens and entries it holds now."""
        cache = self.prefix_cache if self.prefix_cache is not None else PrefixCache(0)
        return {**cache.stats.as_dict(), "tokens": cache.tokens, "entries": len(cache)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's live tensors: in-place writes (at a step boundary) change generation."""
        return self.model.state_dict()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy ``weights`` into the live tensors at the next step boundary and set ``policy_version``.

        Names and shapes are checked before anything is written, so a bad update changes nothing.
        Blocks until applied (immediately when idle).
        """
        live = self.state_dict()
        updates = list(weights)
        for name, tensor in updates:
            if name not in live:
                raise KeyError(f"unknown weight {name!r}")
            if tuple(tensor.shape) != tuple(live[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != live {tuple(live[name].shape)}")

        def apply() -> None:
            with torch.no_grad():
                for name, tensor in updates:
                    live[name].copy_(tensor)
            self.policy_version = version

        self.swap_point.submit(apply).result()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Complete ``requests`` (joining whatever is in flight); results come back in request order."""
        futures = self.submit(requests)
        self.drive(futures)
        return [f.result() for f in futures]

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future[GenerationResult]]:
        """Queue ``requests`` for the next step boundary; never blocks. Someone must `drive` them."""
        for r in requests:
            if len(r.prompt_ids) + r.max_new_tokens > self.model.max_seq_len:
                raise ValueError(
                    f"request {r.request_id!r}: prompt ({len(r.prompt_ids)}) + max_new_tokens "
                    f"({r.max_new_tokens}) exceeds the model's max_seq_len ({self.model.max_seq_len})"
                )
            if r.stop and self.tokenizer is None:
                raise ValueError(f"request {r.request_id!r} has stop strings but the engine has no tokenizer")
            if r.constraint is not None and self.grammars is None:
                raise ValueError(f"request {r.request_id!r} is constrained but the engine has no grammars")
        now = time.perf_counter()
        rows = [_Row(request=r, seed=self._row_seed(r), future=Future(), submitted=now,
                     constraint=self._grammar_state(r)) for r in requests]
        with self._cond:
            self._waiting.extend(rows)
        return [row.future for row in rows]

    def drive(self, futures: Sequence[Future[Any]]) -> None:
        """Run steps until every one of ``futures`` (of submitted requests) is done.

        Any number of threads may call it; one drives at a time, the others wait for their results or
        for the driver to hand over (it stops once its own futures are done).
        """
        with self._cond:
            self._cond.wait_for(lambda: _all_done(futures) or not self._driving)
            if _all_done(futures):
                return
            self._driving = True
        try:
            while not _all_done(futures):
                if self._batch is None and not self._rows and not self._waiting:
                    raise RuntimeError("waiting for futures that were not submitted to this engine")
                self._step()
                with self._cond:
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()

    # -- one step -------------------------------------------------------------------------------------

    def _step(self) -> None:
        """Boundary, decode, retire, refill (see the module docstring); a failure fails every row in play."""
        with self.swap_point.generating(), torch.no_grad():
            try:
                if self.static:
                    if self._rows:
                        self._boundary()
                        self._decode_static()
                        self._retire_static()
                    self._admit_static()
                    return
                if self._batch is not None:
                    self._boundary()
                    self._batch = self._retire(self._decode(self._batch))
                self._admit()
            except Exception as exc:
                self._fail(exc)

    def _newcomers(self, in_flight: int) -> list[_Row]:
        if in_flight and not self.continuous:
            return []
        with self._cond:
            take = min(self.max_batch - in_flight, len(self._waiting))
            newcomers = [self._waiting.popleft() for _ in range(take)]
        self._admitting = newcomers
        if in_flight and newcomers:
            self.merges += 1
        return newcomers

    def _prefix_hit(self, row: _Row) -> tuple[Prefix, int] | None:
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.match(np.asarray(row.request.prompt_ids, dtype=np.int64), self.policy_version)

    # -- the static path (`rlbus.engines.static`) ----------------------------------------------------

    def _admit_static(self) -> None:
        newcomers = self._newcomers(len(self._rows))
        if not newcomers:
            return
        if self._arena is None:
            assert self._fwd is not None
            self._arena = StaticBatch(self._fwd, self.max_batch, max_cols=2 * self.model.max_seq_len)
        arena = self._arena
        hits = [(row, self._prefix_hit(row)) for row in newcomers]
        misses = [row for row, hit in hits if hit is None]
        end = max(len(row.request.prompt_ids) for row in newcomers)
        remaining = max(row.remaining for row in [*self._rows, *newcomers])
        arena.make_room(end, remaining)
        device = self.model.device
        admitted = time.perf_counter()
        version = self.policy_version
        groups: list[tuple[list[_Row], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        if misses:
            lengths = [len(row.request.prompt_ids) for row in misses]
            P = max(lengths)
            ids = torch.full((len(misses), P), self.pad_id, dtype=torch.long)  # [g, P] left padded
            valid = torch.zeros(len(misses), P, dtype=torch.bool)  # [g, P]
            for i, row in enumerate(misses):
                row.admitted = admitted
                ids[i, P - lengths[i] :] = torch.tensor(row.request.prompt_ids, dtype=torch.long)
                valid[i, P - lengths[i] :] = True
            params = SamplingParams.of([row.sampling for row in misses], device)
            allowed = self._allowed(misses, arena.fwd.vocab, device)
            out = arena.prefill(ids.to(device), valid.to(device), lengths, params, allowed=allowed)
            if self.prefix_cache is not None:
                self.prefix_cache.stats.prefilled_tokens += sum(lengths)
            self._rows += misses
            groups.append((misses, out))
        for row, hit in hits:
            if hit is None:
                continue
            prefix, n = hit
            row.admitted, row.cached = admitted, n
            prompt = row.request.prompt_ids
            suffix = torch.tensor(prompt[n:], dtype=torch.long, device=device)[None]  # [1, s]
            valid = torch.ones(1, len(prompt), dtype=torch.bool, device=device)  # [1, n + s]
            params = SamplingParams.of([row.sampling], device)
            out = arena.prefill(suffix, valid, [len(prompt)], params, cached=prefix.slots, cached_len=n,
                                allowed=self._allowed([row], arena.fwd.vocab, device))
            assert self.prefix_cache is not None
            self.prefix_cache.stats.prefilled_tokens += len(prompt) - n
            self._rows.append(row)
            groups.append(([row], out))
        for rows, (tokens, token_logp, logp) in groups:
            host_tokens, host_logps = torch.stack([tokens.double(), token_logp.double()]).tolist()
            self._record(rows, host_tokens, host_logps, logp, version)
        self._admitting = []
        self._retire_static()

    def _decode_static(self) -> None:
        """One decode step of every row in flight: a graph replay on CUDA, else the eager step."""
        arena = self._arena
        assert arena is not None
        version = self.policy_version
        truncate = any(row.truncates for row in self._rows)
        allowed = self._allowed(self._rows, arena.fwd.vocab, self.model.device)
        if self.graphs is not None and self.graphs.enabled and allowed is None:
            self.graphs.run(arena, truncate=truncate)
        else:
            arena.step(arena.n, graph=False, truncate=truncate, allowed=allowed)
        arena.advanced()
        tokens, logps = arena.read()
        assert arena.logp is not None
        self._record(self._rows, tokens, logps, arena.logp, version)

    def _retire_static(self) -> None:
        arena = self._arena
        assert arena is not None
        keep = [i for i, row in enumerate(self._rows) if row.finish is None]
        for i, row in enumerate(self._rows):
            if row.finish is None:
                continue
            if self.prefix_cache is not None and len(set(row.versions)) == 1:
                self._keep(row, arena.row_slots(i), None)
            row.future.set_result(self._result(row))
        if len(keep) < len(self._rows):
            order = arena.retire(keep)
            self._rows = [self._rows[i] for i in order]

    # -- the dynamic path -----------------------------------------------------------------------------

    def _admit(self) -> None:
        newcomers = self._newcomers(0 if self._batch is None else len(self._batch.rows))
        if not newcomers:
            return
        batches, misses = [], []
        for row in newcomers:
            hit = self._prefix_hit(row)
            if hit is None:
                misses.append(row)
            else:
                batches.append(self._prefill_cached(row, *hit))
        if misses:
            batches.insert(0, self._prefill(misses))
        for batch in batches:
            fresh = self._retire(batch)
            if fresh is not None:
                self._batch = fresh if self._batch is None else self._merge(self._batch, fresh)
        self._admitting = []

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """The newcomers' prompts as one left-padded [B, P] forward; samples each row's first token."""
        device = self.model.device
        admitted = time.perf_counter()
        lengths = [len(row.request.prompt_ids) for row in rows]
        B, P = len(rows), max(lengths)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long, device=device)  # [B, P] left padded
        valid = torch.zeros(B, P, dtype=torch.bool, device=device)  # [B, P]
        for i, row in enumerate(rows):
            row.admitted = admitted
            ids[i, P - lengths[i] :] = torch.tensor(row.request.prompt_ids, dtype=torch.long, device=device)
            valid[i, P - lengths[i] :] = True
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, P] per-row positions

        version = self.policy_version
        cache = self.model.new_cache(B, P + max(row.remaining for row in rows))
        out = self.model.forward(ids, positions=positions, key_mask=valid, cache=cache, logits_to_keep=1)
        if out.routed_experts is not None:  # [L, B, P, k]
            for i, row in enumerate(rows):
                row.experts.append(out.routed_experts[:, i, P - lengths[i] :])  # [L, lengths[i], k]
        if self.prefix_cache is not None:
            self.prefix_cache.stats.prefilled_tokens += sum(lengths)
        params = SamplingParams.of([row.sampling for row in rows], device)
        last = self._sample(rows, out.logits[:, -1], version, params)  # [B]
        return _Batch(rows=rows, cache=out.cache, key_mask=valid, next_pos=positions[:, -1] + 1, last=last,
                      params=params)

    def _prefill_cached(self, row: _Row, prefix: Prefix, n: int) -> _Batch:
        """One newcomer started from the first ``n`` slots of a kept row: only prompt[n:] is fed."""
        device = self.model.device
        row.admitted, row.cached = time.perf_counter(), n
        prompt = row.request.prompt_ids
        suffix = torch.tensor(prompt[n:], dtype=torch.long, device=device)[None]  # [1, s]
        total = len(prompt)
        positions = torch.arange(n, total, device=device)[None]  # [1, s]: the row's own positions
        key_mask = torch.ones(1, total, dtype=torch.bool, device=device)  # [1, n + s]
        version = self.policy_version
        capacity = total + row.remaining
        cache = kv.restore(self.model.new_cache(1, capacity), prefix.slots, n, capacity=capacity)
        out = self.model.forward(suffix, positions=positions, key_mask=key_mask, cache=cache, logits_to_keep=1)
        if out.routed_experts is not None:  # [L, 1, s, k]
            if prefix.experts is None:
                raise RuntimeError("a prefix-cache entry of a MoE model has no routed experts")
            row.experts += [prefix.experts[:, :n], out.routed_experts[:, 0]]  # [L, n, k], [L, s, k]
        assert self.prefix_cache is not None
        self.prefix_cache.stats.prefilled_tokens += total - n
        params = SamplingParams.of([row.sampling], device)
        last = self._sample([row], out.logits[:, -1], version, params)  # [1]
        return _Batch(rows=[row], cache=out.cache, key_mask=key_mask, next_pos=positions[:, -1] + 1, last=last,
                      params=params)

    def _decode(self, batch: _Batch) -> _Batch:
        """Feed every row its newest token: one slot more for all rows, one token sampled per row."""
        B = len(batch.rows)
        version = self.policy_version
        key_mask = torch.cat([batch.key_mask, batch.key_mask.new_ones(B, 1)], dim=1)  # [B, S + 1]
        out = self.model.forward(
            batch.last[:, None], positions=batch.next_pos[:, None], key_mask=key_mask, cache=batch.cache
        )
        if out.routed_experts is not None:  # [L, B, 1, k]
            for i, row in enumerate(batch.rows):
                row.experts.append(out.routed_experts[:, i])  # [L, 1, k]
        batch.cache, batch.key_mask, batch.next_pos = out.cache, key_mask, batch.next_pos + 1
        batch.last = self._sample(batch.rows, out.logits[:, -1], version, batch.params)  # [B]
        return batch

    def _sample(self, rows: list[_Row], logits: torch.Tensor, version: int, params: SamplingParams) -> torch.Tensor:
        """Sample one token per row from logits [B, V] and record it; returns the tokens [B]."""
        params.truncate = any(row.truncates for row in rows)
        allowed = self._allowed(rows, logits.shape[-1], logits.device)
        tokens, token_logp, logp = draw(logits, params, allowed=allowed)  # [B], [B], [B, V]
        host_tokens, host_logps = torch.stack([tokens.double(), token_logp.double()]).tolist()  # the one copy
        self._record(rows, host_tokens, host_logps, logp, version)
        return tokens

    def _record(self, rows: list[_Row], tokens: Sequence[float], logps: Sequence[float], logp: torch.Tensor,
                version: int) -> None:
        """Append each row's sampled token (and its top log-probs when asked: one more copy, then); a
        constrained row's grammar consumes it."""
        states = [row.constraint for row in rows]
        if any(state is not None for state in states):
            advance(states, [int(t) for t in tokens])
        k = max(row.request.top_logprobs for row in rows)
        if k:
            top_lp, top_ids = logp[: len(rows)].topk(min(k, logp.shape[-1]), dim=-1)  # [B, k] each
            ids, lps = top_ids.tolist(), top_lp.tolist()
            for i, row in enumerate(rows):
                n = row.request.top_logprobs
                if n:
                    row.top.append(list(zip(ids[i][:n], lps[i][:n], strict=True)))
        for row, token, lp in zip(rows, tokens, logps, strict=True):
            self._append(row, int(token), lp, version)

    def _allowed(self, rows: list[_Row], vocab: int, device: torch.device) -> torch.Tensor | None:
        """The constrained-decoding hook: [B, V] bool, True where row i may sample next (its grammar's mask;
        all True for an unconstrained row), or None when no row is constrained."""
        states = [row.constraint for row in rows]
        if all(state is None for state in states):
            return None
        return mask_logits(states, torch.zeros(len(rows), vocab, device=device)) == 0  # [B, V]

    def _retire(self, batch: _Batch) -> _Batch | None:
        """Deliver finished rows and drop them, with the leading slots no remaining row uses."""
        keep = [i for i, row in enumerate(batch.rows) if row.finish is None]
        for i, row in enumerate(batch.rows):
            if row.finish is not None:
                if self.prefix_cache is not None and len(set(row.versions)) == 1:
                    slots = batch.key_mask[i]  # [S] the row's real slots
                    experts = torch.cat(row.experts, dim=1) if row.experts else None  # [L, fed, k]
                    self._keep(row, kv.row_slots(batch.cache, i, slots), experts)
                row.future.set_result(self._result(row))
        if len(keep) == len(batch.rows):
            return batch
        if not keep:
            return None
        idx = torch.tensor(keep, dtype=torch.long, device=batch.key_mask.device)  # [B']
        rows = [batch.rows[i] for i in keep]
        key_mask = batch.key_mask[idx]  # [B', S]
        start = int(key_mask.any(dim=0).int().argmax())  # first slot a remaining row uses (rows right-aligned)
        key_mask = key_mask[:, start:]  # [B', S - start]
        capacity = key_mask.shape[1] + max(row.remaining for row in rows)
        cache = kv.select(batch.cache, idx, start, capacity=capacity)
        params = batch.params.select(idx, any(row.truncates for row in rows))
        return _Batch(rows=rows, cache=cache, key_mask=key_mask, next_pos=batch.next_pos[idx], last=batch.last[idx],
                      params=params)

    def _keep(self, row: _Row, slots: list[tuple[torch.Tensor, torch.Tensor]], experts: torch.Tensor | None) -> None:
        """Hand a finished row's fed tokens (prompt + all sampled but the last) and their keys/values
        (per layer [1, H, fed, D]) to the prefix cache. A row whose forwards spanned a weight swap holds mixed
        keys/values: the caller does not keep it."""
        assert self.prefix_cache is not None
        ids = np.asarray((*row.request.prompt_ids, *row.tokens[:-1]), dtype=np.int64)
        held = int(slots[0][0].shape[2]) if slots else len(ids)
        if held != len(ids):
            raise RuntimeError(f"row {row.request.request_id!r}: {held} cache slots for {len(ids)} fed tokens")
        self.prefix_cache.add(Prefix(ids=ids, slots=slots, version=row.versions[0], experts=experts))

    def _merge(self, a: _Batch, b: _Batch) -> _Batch:
        """Rows of ``a`` then ``b``; the shorter side is left padded so both end at one offset."""
        S = max(a.key_mask.shape[1], b.key_mask.shape[1])
        rows = a.rows + b.rows
        key_mask = torch.cat([_left_pad(a.key_mask, S), _left_pad(b.key_mask, S)])  # [B_a + B_b, S]
        cache = kv.merge(a.cache, b.cache, capacity=S + max(row.remaining for row in rows))
        return _Batch(
            rows=rows,
            cache=cache,
            key_mask=key_mask,
            next_pos=torch.cat([a.next_pos, b.next_pos]),
            last=torch.cat([a.last, b.last]),
            params=SamplingParams.cat(a.params, b.params),
        )

    def _fail(self, exc: Exception) -> None:
        rows = ([] if self._batch is None else self._batch.rows) + self._rows + self._admitting
        self._batch, self._admitting, self._rows = None, [], []
        if self._arena is not None:
            self._arena.retire([])
        for row in rows:
            if not row.future.done():
                row.future.set_exception(exc)

    # -- per row --------------------------------------------------------------------------------------

    def _row_seed(self, request: GenerationRequest) -> int:
        return row_key(self._seeds.getrandbits(63) if request.seed is None else request.seed)

    def _grammar_state(self, request: GenerationRequest) -> RowConstraint | None:
        if request.constraint is None or self.grammars is None:
            return None
        return self.grammars.start(request.constraint)

    def _boundary(self) -> None:
        if self.between_steps is not None:
            self.between_steps()
        self.swap_point.at_boundary()

    def _append(self, row: _Row, token: int, logprob: float, version: int) -> None:
        """Record one sampled token and decide whether the row is finished."""
        req = row.request
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.versions.append(version)
        if req.on_token is not None:
            req.on_token(token)
        if token in req.stop_token_ids:
            row.finish, row.text = "stop", self._decode_text(row.tokens[:-1])
            return
        if req.stop:
            text = self._decode_text(row.tokens)
            hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
            if hits:
                row.finish, row.text = "stop", text[: min(hits)]
                return
        if len(row.tokens) >= req.max_new_tokens:
            row.finish, row.text = "length", self._decode_text(row.tokens)

    def _decode_text(self, tokens: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(tokens)

    @staticmethod
    def _result(row: _Row) -> GenerationResult:
        req = row.request
        assert row.finish is not None, "every row finishes within max_new_tokens steps"
        # The experts of every input token: the prompt (prefill), then each generated token but the last
        # (one decode step each; a row is dropped as soon as it finishes, so it is never fed padding).
        routed = torch.cat(row.experts, dim=1).to(torch.int16).cpu() if row.experts else None  # [L, P + N - 1, k]
        extra: dict[str, Any] = {
            "engine": "torch",
            "wait_seconds": row.admitted - row.submitted,
            "run_seconds": time.perf_counter() - row.admitted,
            "cached_prompt_tokens": row.cached,
        }
        if req.top_logprobs:
            extra["top_logprobs"] = row.top
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=tuple(req.prompt_ids),
            token_ids=tuple(row.tokens),
            logprobs=torch.tensor(row.logprobs, dtype=torch.float32),
            policy_versions=tuple(row.versions),
            text=row.text,
            finish_reason=row.finish,
            logprob_spec=LogprobSpec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                     constrained=row.constraint is not None),
            routed_experts=routed,
            extra=extra,
            allowed=None if row.constraint is None else row.constraint.bits(),
        )


def _all_done(futures: Sequence[Future[Any]]) -> bool:
    return all(f.done() for f in futures)


def _left_pad(mask: torch.Tensor, S: int) -> torch.Tensor:
    """[B, n] → [B, S] with S - n False columns in front."""
    return torch.cat([mask.new_zeros(mask.shape[0], S - mask.shape[1]), mask], dim=1)
