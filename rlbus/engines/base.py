"""What every inference engine takes and returns, and how weight swaps reach a generating engine.

An engine turns `GenerationRequest`s into `GenerationResult`s. A result carries everything the trainer
needs to correct for off-policy data (docs/architecture.md §5): the log-probability of every sampled token under the
distribution it was *actually sampled from* (after temperature and top-k/top-p truncation, renormalised),
a `LogprobSpec` saying so, the policy version that produced each token, and — for MoE models — the
experts every input token was routed to, for router replay.

Weight swaps happen between decode steps, never during a forward pass. `SwapPoint` is the hand-off: the
weight-sync worker (an asyncio task or any thread) submits a swap callable; the generating thread runs it
at its next step boundary, or it runs at once when no generation is in flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from rlbus.engines.constraints import Constraint

T = TypeVar("T")

FinishReason = Literal["stop", "length"]


class TokenDecoder(Protocol):
    """Turns token ids into text (for stop strings and `GenerationResult.text`)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt to complete. Sampling follows vLLM's order: temperature, then top-k, then top-p."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids; at least one."""
    max_new_tokens: int
    """Upper bound on generated tokens (finish reason "length" when reached)."""
    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy: the distribution is the point mass on the argmax, so every
    recorded log-prob is exactly 0.0 (log 1) and a trainer has no stochastic policy to correct."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 = off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the decoded completion contains one; the text is cut before it."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (e.g. EOS); the stop token stays in token_ids, out of the text."""
    seed: int | None = None
    """Per-request sampling seed; None uses the engine's seeded generator."""
    request_id: str = ""
    """Caller's id, echoed in the result."""
    top_logprobs: int = 0
    """Also report the ``top_logprobs`` most likely ids of each step's sampled distribution (log π', the
    processed one) in ``GenerationResult.extra["top_logprobs"]``; 0 = off. The gateway's OpenAI field."""
    constraint: Constraint | None = None
    """A grammar every sampled token must follow (`rlbus.engines.constraints`): its allowed-token mask is
    applied to the logits before temperature, top-k and top-p; None: unconstrained."""
    on_token: Callable[[int], None] | None = field(default=None, compare=False, repr=False)
    """Called with each sampled id as soon as it is sampled, on the generating thread (must not block):
    how the gateway streams tokens while the row is still in the running batch."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("prompt_ids must not be empty")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if self.top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0 (0 = off)")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class LogprobSpec:
    """How `GenerationResult.logprobs` were computed.

    ``processed=True``: log π'(x), π' = softmax(logits / temperature) restricted to the top-k, then to the
    top-p nucleus, and renormalised — the distribution the token was drawn from. Temperature 0 is greedy:
    π' is a point mass on the argmax and every log-prob is 0. A trainer comparing its own log-probs with
    these must either apply the same processing or count the difference as off-policy-ness.

    ``constrained=True``: a grammar's allowed-token mask was applied to the logits first (π' is zero outside
    it, before temperature and truncation); the masks are in `GenerationResult.allowed`, and a trainer
    applies the same masks (`rlbus.rl.logprobs.chunked_token_logprobs`).
    """

    temperature: float
    top_p: float
    top_k: int
    processed: bool = True
    constrained: bool = False


@dataclass(frozen=True)
class GenerationResult:
    """A completed request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """Generated ids, including a final stop token or the token that completed a stop string."""
    logprobs: torch.Tensor
    """[N] float32: log-prob of each generated token under the sampled distribution (see `LogprobSpec`)."""
    policy_versions: tuple[int, ...]
    """[N] the engine's policy_version when each token's distribution was computed."""
    text: str
    """Decoded completion, cut before a stop string, without a stop token; "" without a decoder."""
    finish_reason: FinishReason
    logprob_spec: LogprobSpec
    routed_experts: torch.Tensor | None = None
    """[L, P + N - 1, k] int: experts each *input* token (the prompt and every generated token but the
    last — the last one is never fed to the model) was routed to in each MoE layer. This is exactly the
    replay input for a trainer forward over ``(prompt + tokens)[:-1]``. None for dense models."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific details (timings, engine name)."""
    allowed: torch.Tensor | None = None
    """[N, W] int32: the allowed-token mask each generated token was sampled under, for a constrained
    request (layout in `rlbus.engines.constraints`); None when unconstrained."""


class Engine(Protocol):
    """An inference engine as rollout workers use it."""

    @property
    def policy_version(self) -> int:
        """The weight version generation currently uses."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Complete every request; results are in request order. Blocking: run it off the event loop."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Replace the named tensors and set ``policy_version``, at a step boundary; blocks until done."""
        ...


class SwapPoint:
    """Runs submitted swap callables at a safe point: between decode steps, or at once when idle.

    Engines wrap each generation in `generating()` and call `at_boundary()` between decode steps; both
    run pending swaps in submission order while holding the lock, so a swap never overlaps a forward
    pass and a generation never starts halfway through a swap. A swap that raises fails only its own
    future; generation goes on (the sync worker then sees the error and falls back, docs/architecture.md §4).

    A swap submitted from the generating thread itself (e.g. from a ``between_steps`` hook) runs at once:
    that thread is at a boundary by construction, and queueing would deadlock on `Future.result`.
    One SwapPoint serves one engine (engines serialise their own generate calls).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._generating = 0
        self._owner: int | None = None

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Schedule ``fn``; the future resolves with its result once it has run."""
        fut: Future[T] = Future()
        with self._lock:
            if self._generating == 0 or self._owner == threading.get_ident():
                self._run(fn, fut)
            else:
                self._pending.append((fn, fut))
        return fut

    async def apply(self, fn: Callable[[], T]) -> T:
        """Asyncio form of `submit`: waits in a worker thread, so the event loop stays free."""
        return await asyncio.to_thread(lambda: self.submit(fn).result())

    def at_boundary(self) -> None:
        """Engine side: run every pending swap now (call between decode steps)."""
        with self._lock:
            self._drain()

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Engine side: marks a generation in flight; swaps submitted meanwhile wait for a boundary."""
        with self._lock:
            self._drain()
            self._generating += 1
            self._owner = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1
                if self._generating == 0:
                    self._owner = None
                self._drain()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _drain(self) -> None:
        while self._pending:
            fn, fut = self._pending.popleft()
            self._run(fn, fut)

    @staticmethod
    def _run(fn: Callable[[], T], fut: Future[T]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except Exception as exc:
            fut.set_exception(exc)
