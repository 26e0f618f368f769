"""Batches generate calls from many concurrent episodes into one engine call.

The agent loop runs each episode on its own thread and asks for one completion at a time; a group of G
episodes therefore issues G small calls at nearly the same moment. Run one by one, a CPU or GPU spends
most of its time on per-call overhead. :class:`BatchingEngine` queues calls for a few milliseconds (or
until ``max_batch`` requests wait) and hands them to the wrapped engine as one batch — the same idea as
vLLM's continuous batching, at the granularity of whole calls. Results go back to each caller in order.
It is itself an :class:`rlbus.engines.base.Engine`, so the agent loop does not know it is there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from rlbus.engines.base import Engine, GenerationRequest, GenerationResult


class BatchingEngine:
    def __init__(self, engine: Engine, *, max_batch: int = 32, window_s: float = 0.005) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.window_s = window_s
        self._cond = threading.Condition()
        self._queue: list[tuple[GenerationRequest, Future[GenerationResult]]] = []
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
        """Enqueue; the first waiting caller becomes the leader and runs the batch for everyone."""
        futures: list[Future[GenerationResult]] = []
        with self._cond:
            for request in requests:
                future: Future[GenerationResult] = Future()
                self._queue.append((request, future))
                futures.append(future)
            self._cond.notify_all()
        while not all(f.done() for f in futures):
            self._lead_or_wait()
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
                self._run(batch)
        finally:
            with self._cond:
                self._leader = False
                self._cond.notify_all()

    def _run(self, batch: list[tuple[GenerationRequest, Future[GenerationResult]]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        try:
            results = self.engine.generate([request for request, _ in batch])
        except BaseException as exc:  # every waiting caller sees the failure, none hangs
            for _, future in batch:
                future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            future.set_result(result)
