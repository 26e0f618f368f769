"""Batches generate calls from many concurrent episodes into shared engine work.

The agent loop runs each episode on its own thread and asks for one completion at a time; a group of G
episodes therefore issues G small calls at nearly the same moment. Run one by one, a CPU or GPU spends
most of its time on per-call overhead. :class:`BatchingEngine` queues calls for a few milliseconds (or
until ``max_batch`` requests wait) and hands them to the wrapped engine together. It is itself an
:class:`rlbus.engines.base.Engine`, so the agent loop does not know it is there.

Two kinds of wrapped engine. A :class:`ContinuousEngine` (`rlbus.engines.torch_engine.TorchEngine`)
takes requests into its running batch at the next step boundary: each flush is `submit`-ted to it and
every caller then helps `drive` the engine until its own results are done, so a short request arriving
while a long one decodes returns without waiting for it. Any other engine gets one blocking ``generate``
call per flush, and calls arriving meanwhile wait for the next flush. Results go back to each caller in
order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch

from rlbus.engines.base import Engine, GenerationRequest, GenerationResult


@runtime_checkable
class ContinuousEngine(Protocol):
    """An engine whose running batch accepts new requests between steps."""

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future[GenerationResult]]:
        """Queue requests for the next step boundary; never blocks."""
        ...

    def drive(self, futures: Sequence[Future[Any]]) -> None:
        """Run steps (or wait for another thread running them) until every future is done."""
        ...


@dataclass
class _Call:
    """One queued request and where its result will appear."""

    request: GenerationRequest
    future: Future[GenerationResult] = field(default_factory=Future)
    handed_over: bool = False


class BatchingEngine:
    def __init__(self, engine: Engine, *, max_batch: int = 32, window_s: float = 0.005) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.window_s = window_s
        self._continuous = isinstance(engine, ContinuousEngine)
        self._cond = threading.Condition()
        self._queue: list[_Call] = []
        self._leader = False
        self.batches = 0
        self.requests = 0

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def __getattr__(self, name: str) -> Any:  # swap_point, state_dict, model … of the wrapped engine
        return getattr(self.engine, name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self.engine.load_weights(weights, version=version)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Enqueue; the first waiting caller becomes the leader and flushes the queue for everyone."""
        calls = [_Call(request) for request in requests]
        with self._cond:
            self._queue.extend(calls)
            self._cond.notify_all()
        while not all(c.handed_over for c in calls):
            self._lead_or_wait()
        futures = [c.future for c in calls]
        if self._continuous:
            self._as_continuous().drive(futures)
        return [f.result() for f in futures]

    def _lead_or_wait(self) -> None:
        with self._cond:
            if self._leader:
                self._cond.wait(timeout=0.05)
                return
            self._leader = True
        try:
            deadline = time.monotonic() + self.window_s
            with self._cond:
                while len(self._queue) < self.max_batch and time.monotonic() < deadline:
                    self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            if batch:
                self.batches += 1
                self.requests += len(batch)
                if self._continuous:
                    self._submit(batch)
                else:
                    self._run(batch)
        finally:
            with self._cond:
                self._leader = False
                self._cond.notify_all()

    def _submit(self, batch: list[_Call]) -> None:
        """Hand the flush to the running engine; each caller's future follows the engine's."""
        try:
            inner = self._as_continuous().submit([c.request for c in batch])
        except BaseException as exc:  # a rejected request fails its whole flush, none hangs
            inner = [Future() for _ in batch]
            for f in inner:
                f.set_exception(exc)
        for call, future in zip(batch, inner, strict=True):
            future.add_done_callback(partial(_copy, target=call.future))
        self._hand_over(batch)

    def _run(self, batch: list[_Call]) -> None:
        """One blocking call of a non-continuous engine."""
        try:
            results = self.engine.generate([c.request for c in batch])
        except BaseException as exc:  # every waiting caller sees the failure, none hangs
            for call in batch:
                call.future.set_exception(exc)
        else:
            for call, result in zip(batch, results, strict=True):
                call.future.set_result(result)
        self._hand_over(batch)

    def _hand_over(self, batch: list[_Call]) -> None:
        with self._cond:
            for call in batch:
                call.handed_over = True
            self._cond.notify_all()

    def _as_continuous(self) -> ContinuousEngine:
        assert isinstance(self.engine, ContinuousEngine)
        return self.engine


def _copy(source: Future[GenerationResult], *, target: Future[GenerationResult]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
