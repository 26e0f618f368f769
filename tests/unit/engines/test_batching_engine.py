"""Concurrent callers share batches, each gets its own results, failures reach every caller."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from rlbus.engines.base import GenerationRequest, GenerationResult, LogprobSpec
from rlbus.engines.batching import BatchingEngine


class Echo:
    policy_version = 3

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.fail = fail

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.calls.append(len(requests))
        if self.fail:
            raise RuntimeError("engine down")
        return [
            GenerationResult(
                request_id=r.request_id, prompt_ids=r.prompt_ids, token_ids=tuple(reversed(r.prompt_ids)),
                logprobs=torch.zeros(len(r.prompt_ids)), policy_versions=(3,) * len(r.prompt_ids), text="",
                finish_reason="length", logprob_spec=LogprobSpec(1.0, 1.0, 0),
            )
            for r in requests
        ]

    def load_weights(self, weights, *, version):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def run_threads(engine: BatchingEngine, n: int) -> dict[int, tuple[int, ...]]:
    out: dict[int, tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            (result,) = engine.generate([GenerationRequest(prompt_ids=(i, i + 1), max_new_tokens=1, request_id=str(i))])
            out[i] = result.token_ids
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    if errors:
        raise errors[0]
    return out


def test_concurrent_calls_are_batched_and_answered_in_order() -> None:
    inner = Echo()
    engine = BatchingEngine(inner, max_batch=8, window_s=0.05)
    out = run_threads(engine, 16)
    assert out == {i: (i + 1, i) for i in range(16)}
    assert sum(inner.calls) == 16 and len(inner.calls) < 16 and max(inner.calls) <= 8
    assert engine.policy_version == 3


def test_engine_failure_reaches_every_caller() -> None:
    engine = BatchingEngine(Echo(fail=True), window_s=0.01)
    with pytest.raises(RuntimeError, match="engine down"):
        run_threads(engine, 4)
