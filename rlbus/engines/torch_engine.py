"""Batched generation in plain PyTorch: KV cache, processed log-probs, routed experts, in-flight swaps.

Batching uses **left padding**. Prompts are right-aligned in a [B, P] block; a key mask marks real
tokens and each row gets its own RoPE positions (0 at its first real token), so a padded row computes what
it would compute alone (up to float rounding). Left padding keeps every row's newest token in the last
column and lets all rows share one cache offset: each decode step appends one slot to every row. Rows that
finish early keep being fed a masked pad token until the whole batch is done.

Per step: forward → `sampling.processed_logprobs` → sample → record (token, log π'(token), policy
version, experts) → stop checks → step boundary. The log-prob is of the distribution actually sampled
from (after temperature and top-k/top-p truncation, renormalised); `GenerationResult.logprob_spec` says
so. The policy version of a token is the engine's ``policy_version`` when its distribution was computed.

Weight swaps. Between decode steps (never before the prefill, never after the last step) the engine runs
its ``between_steps`` hook, then every swap pending on its `SwapPoint`. A swap writes into the live
tensors of `state_dict()` in place and sets ``policy_version``; the following tokens carry the new
version. Keys/values already in the cache were computed by the old weights and are not recomputed — the
usual in-flight update trade-off, visible to the trainer through the per-token versions.

`generate` blocks; call it from a worker thread (``asyncio.to_thread``) so the event loop stays free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbus.engines.base import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LogprobSpec,
    SwapPoint,
    TokenDecoder,
)
from rlbus.engines.sampling import processed_logprobs, sample
from rlbus.models.base import CausalLM


@dataclass
class _Row:
    """Mutable per-request state during one `generate` call."""

    request: GenerationRequest
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str = ""


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
    ) -> None:
        """``pad_id`` is fed at padding slots (any valid id: those slots are masked);
        ``between_steps`` runs between decode steps, before pending swaps."""
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.policy_version = policy_version
        self.between_steps = between_steps
        self.swap_point = swap_point if swap_point is not None else SwapPoint()
        self._generator = torch.Generator(device=model.device).manual_seed(seed)
        self._lock = threading.Lock()

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
        """Complete ``requests`` as one left-padded batch; results come back in request order."""
        if not requests:
            return []
        for r in requests:
            if len(r.prompt_ids) + r.max_new_tokens > self.model.max_seq_len:
                raise ValueError(
                    f"request {r.request_id!r}: prompt ({len(r.prompt_ids)}) + max_new_tokens "
                    f"({r.max_new_tokens}) exceeds the model's max_seq_len ({self.model.max_seq_len})"
                )
            if r.stop and self.tokenizer is None:
                raise ValueError(f"request {r.request_id!r} has stop strings but the engine has no tokenizer")
        with self._lock, self.swap_point.generating(), torch.no_grad():
            return self._generate(requests)

    def _generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        started = time.perf_counter()
        device = self.model.device
        rows = [_Row(request=r, generator=self._row_generator(r)) for r in requests]
        B = len(rows)
        lengths = [len(r.prompt_ids) for r in requests]
        P, N = max(lengths), max(r.max_new_tokens for r in requests)

        ids = torch.full((B, P), self.pad_id, dtype=torch.long, device=device)  # [B, P] left padded
        valid = torch.zeros(B, P, dtype=torch.bool, device=device)  # [B, P]
        for i, r in enumerate(requests):
            ids[i, P - lengths[i] :] = torch.tensor(r.prompt_ids, dtype=torch.long, device=device)
            valid[i, P - lengths[i] :] = True
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, P] per-row positions
        next_pos = positions[:, -1] + 1  # [B] position of each row's next token

        temperature = torch.tensor([r.temperature for r in requests], device=device)  # [B]
        top_k = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=device)  # [B]
        top_p = torch.tensor([r.top_p for r in requests], device=device)  # [B]

        cache = self.model.new_cache(B, P + N)
        key_mask = valid  # [B, S] grows by one column per step
        step_ids, step_pos = ids, positions  # [B, T] new tokens of this step
        expert_chunks: list[torch.Tensor] = []  # [L, B, T, k] per forward
        for step in range(N):
            if step > 0:
                self._boundary()
            version = self.policy_version
            out = self.model.forward(step_ids, positions=step_pos, key_mask=key_mask, cache=cache)
            cache = out.cache
            if out.routed_experts is not None:
                expert_chunks.append(out.routed_experts)
            logp = processed_logprobs(out.logits[:, -1], temperature, top_k, top_p)  # [B, V]
            tokens = sample(logp, [row.generator for row in rows])  # [B]
            token_logp = logp.gather(1, tokens[:, None]).squeeze(1)  # [B]

            for row, token, lp in zip(rows, tokens.tolist(), token_logp.tolist(), strict=True):
                if row.finish is None:
                    self._append(row, token, lp, version)
            active = torch.tensor([row.finish is None for row in rows], device=device)  # [B]
            if not bool(active.any()):
                break
            step_ids = torch.where(active, tokens, torch.full_like(tokens, self.pad_id))[:, None]  # [B, 1]
            step_pos = next_pos[:, None]  # [B, 1]
            next_pos = next_pos + active.long()
            key_mask = torch.cat([key_mask, active[:, None]], dim=1)  # [B, S + 1]

        experts = torch.cat(expert_chunks, dim=2) if expert_chunks else None  # [L, B, P + steps - 1, k]
        elapsed = time.perf_counter() - started
        results = []
        for i, row in enumerate(rows):
            routed = None
            if experts is not None:
                # Row i's inputs: its prompt (last lengths[i] of the P prompt columns), then its generated
                # tokens but the last, which were fed at the columns right after the prompt block.
                routed = experts[:, i, P - lengths[i] : P + len(row.tokens) - 1].to(torch.int16).cpu()
            results.append(self._result(row, routed, elapsed))
        return results

    def _row_generator(self, request: GenerationRequest) -> torch.Generator:
        if request.seed is None:
            return self._generator
        return torch.Generator(device=self.model.device).manual_seed(request.seed)

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
        if token in req.stop_token_ids:
            row.finish, row.text = "stop", self._decode(row.tokens[:-1])
            return
        if req.stop:
            text = self._decode(row.tokens)
            hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
            if hits:
                row.finish, row.text = "stop", text[: min(hits)]
                return
        if len(row.tokens) >= req.max_new_tokens:
            row.finish, row.text = "length", self._decode(row.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(tokens)

    @staticmethod
    def _result(row: _Row, routed: torch.Tensor | None, elapsed: float) -> GenerationResult:
        req = row.request
        assert row.finish is not None, "every row finishes within max_new_tokens steps"
        extra: dict[str, Any] = {"engine": "torch", "batch_seconds": elapsed}
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=tuple(req.prompt_ids),
            token_ids=tuple(row.tokens),
            logprobs=torch.tensor(row.logprobs, dtype=torch.float32),
            policy_versions=tuple(row.versions),
            text=row.text,
            finish_reason=row.finish,
            logprob_spec=LogprobSpec(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            routed_experts=routed,
            extra=extra,
        )
