"""CUDA graphs of the static decode step, one per batch-size bucket, so a decode step is one launch.

A 135 M-parameter model's decode step is a few hundred small kernels; launched one by one from Python it is
bound by the host (126 ms a step at batch 1 on an H200, where the kernels take a few). `StepGraphs`
captures `rlbus.engines.static.StaticBatch.step` (its capturable form) into a ``torch.cuda.CUDAGraph`` the
first time a (bucket, truncation) pair is needed — that first step runs eagerly, which is the warm-up
capture needs — and replays it afterwards. Buckets are powers of two up to ``max_batch`` (and
``max_batch``): a batch of n rows runs the graph of the smallest bucket >= n, its idle slots computing
harmlessly. Graphs share one memory pool.

``capture=False`` runs the same capturable step eagerly, bucket and all: what the CPU tests check the graph
form with (the capture itself needs CUDA).

A graph bakes in addresses: the arena's buffers and the weights. It is keyed by the arena's generation
(reallocated when it grows) and by the weights' addresses — weight sync's double buffering re-points the
parameters at a spare copy each version, so graphs of the last two weight addresses are kept and a swap
costs no recapture after the first two. A capture that fails (an op that cannot be captured on this build)
turns graphs off for the engine, with a warning; the eager step computes the same thing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from rlbus.engines.static import StaticBatch

log = logging.getLogger(__name__)
#: One capture at a time in a process (several engines — rollout workers, an evaluation — may share a GPU).
_capturing = threading.Lock()


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, … below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class StepGraphs:
    """Captured decode steps of one `StaticBatch` (see the module docstring)."""

    def __init__(self, max_batch: int, *, capture: bool = True) -> None:
        self.buckets = buckets(max_batch)
        self.capture = capture
        self.enabled = True
        self.captures = 0
        self.replays = 0
        self._graphs: dict[tuple[Any, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, batch: StaticBatch, *, truncate: bool) -> None:
        """One decode step of ``batch``'s rows: a replay, or an eager step followed by a capture."""
        b = self.bucket(batch.n)
        if not self.capture:
            batch.col.fill_(batch.pos)
            batch.step(b, graph=True, truncate=truncate)
            return
        signature = batch.fwd.weights_signature()
        key = (batch.generation, signature, b, truncate)
        batch.col.fill_(batch.pos)
        found = self._graphs.get(key)
        if found is not None:
            graph, logp = found
            graph.replay()
            batch.logp = logp
            self.replays += 1
            return
        batch.step(b, graph=True, truncate=truncate)  # a real step, and capture's warm-up
        self._evict(batch.generation, signature)
        eager_logp = batch.logp
        graph = torch.cuda.CUDAGraph()
        try:
            with _capturing, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                batch.step(b, graph=True, truncate=truncate)
        except Exception as exc:  # an op that cannot be captured here: the eager step is as exact
            log.warning("CUDA graph capture failed (%s); decoding without graphs", exc)
            self.enabled = False
            self._graphs.clear()
            batch.logp = eager_logp
            return
        assert batch.logp is not None
        self._graphs[key] = (graph, batch.logp)
        self._pool = graph.pool()
        self.captures += 1
        batch.logp = eager_logp

    def _evict(self, generation: int, signature: tuple[int, ...]) -> None:
        """Drop graphs of another arena, and of weight addresses other than the two newest."""
        signatures: list[tuple[int, ...]] = []
        for key in self._graphs:
            if key[1] not in signatures:
                signatures.append(key[1])
        keep = ({signature, signatures[-1]} if signatures else {signature})
        for key in list(self._graphs):
            if key[0] != generation or key[1] not in keep:
                del self._graphs[key]
