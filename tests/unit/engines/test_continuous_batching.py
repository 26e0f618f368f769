"""Continuous batching: refilled rows compute what they would alone; short requests overtake long ones."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from rlbus.engines import kv
from rlbus.engines.base import GenerationRequest, GenerationResult
from rlbus.engines.batching import BatchingEngine
from rlbus.engines.torch_engine import TorchEngine
from rlbus.models.base import LMOutput
from rlbus.models.policy import Policy, PolicyConfig

CFG = PolicyConfig.tiny()  # MoE: 4 experts, top-2
assert CFG.moe


def _mixed(n: int, vocab: int, **kw: Any) -> list[GenerationRequest]:
    """Prompts of 1..11 tokens, max_new_tokens cycling through 1..17: rows finish and refill at odd steps."""
    g = torch.Generator().manual_seed(11)
    return [
        GenerationRequest(
            prompt_ids=tuple(torch.randint(1, vocab, (1 + (5 * i) % 11,), generator=g).tolist()),
            max_new_tokens=(1, 9, 3, 17, 2, 6)[i % 6], request_id=str(i), **kw,
        )
        for i in range(n)
    ]


def _count_merges(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    merges: list[int] = []
    merge = kv.merge

    def counting(a: Any, b: Any, *, capacity: int) -> Any:
        merges.append(capacity)
        return merge(a, b, capacity=capacity)

    monkeypatch.setattr(kv, "merge", counting)
    return merges


@pytest.mark.parametrize("model_name", ["policy", "llama"])
def test_greedy_results_with_refill_equal_running_each_request_alone(
    model_name: str, request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(model_name)
    vocab = CFG.vocab if model_name == "policy" else 512
    reqs = _mixed(10, vocab, temperature=0.0)
    alone = [TorchEngine(model).generate([r])[0] for r in reqs]
    engine = TorchEngine(model, max_batch=3)
    batched = engine.generate(reqs)
    assert engine.merges, "newcomers were merged into a running batch"
    for a, b in zip(alone, batched, strict=True):
        assert b.request_id == a.request_id
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert torch.equal(b.logprobs, torch.zeros(len(b.token_ids)))


def test_routed_experts_and_logprobs_survive_merges_and_drops(policy: Policy, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _mixed(9, CFG.vocab)  # temperature 1: log π' is the plain log-softmax of the full forward
    merges = _count_merges(monkeypatch)
    results = TorchEngine(policy, seed=4, max_batch=3).generate(reqs)
    assert merges
    for req, res in zip(reqs, results, strict=True):
        inputs = req.prompt_ids + res.token_ids[:-1]  # the last token is never fed
        full = policy(torch.tensor([inputs]))
        assert full.routed_experts is not None and res.routed_experts is not None
        assert res.routed_experts.shape == (CFG.n_layer, len(inputs), CFG.top_k)
        assert torch.equal(res.routed_experts.long(), full.routed_experts[:, 0])
        P = len(req.prompt_ids)
        expected = full.logits[0, P - 1 :].log_softmax(-1).gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(res.logprobs, expected, atol=2e-4, rtol=0)


def test_seeded_requests_sample_the_same_tokens_in_any_batch(policy: Policy) -> None:
    reqs = [
        GenerationRequest(prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens, seed=100 + i, temperature=0.9)
        for i, r in enumerate(_mixed(7, CFG.vocab))
    ]
    alone = [TorchEngine(policy).generate([r])[0].token_ids for r in reqs]
    assert [r.token_ids for r in TorchEngine(policy, max_batch=2).generate(reqs)] == alone


def test_cache_stays_compact_and_within_the_longest_context(policy: Policy) -> None:
    seen: list[tuple[int, int]] = []

    def check() -> None:
        batch = engine._batch
        assert batch is not None
        S = batch.key_mask.shape[1]
        assert kv.length(batch.cache) == S
        assert bool(batch.key_mask[:, 0].any()), "no leading all-padding slot"
        longest = max(len(row.request.prompt_ids) + len(row.tokens) - 1 for row in batch.rows)
        assert S == longest  # rows are right-aligned, so S is the longest context in flight
        assert batch.cache.max_len <= S + max(row.remaining for row in batch.rows)
        seen.append((len(batch.rows), S))

    engine = TorchEngine(policy, max_batch=4, between_steps=check)
    engine.generate(_mixed(16, CFG.vocab, temperature=0.0))
    assert seen and max(rows for rows, _ in seen) == 4


class NextByte(torch.nn.Module):
    """Greedy continues "last id + 1"; no cache. Counts forwards; can fail once at a given call."""

    def __init__(self, fail_at: int = 0) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at = fail_at

    @property
    def max_seq_len(self) -> int:
        return 256

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_cache(self, batch: int, max_len: int) -> Any:
        return None

    def forward(self, idx: torch.Tensor, *, positions: Any = None, key_mask: Any = None, cache: Any = None,
                logits_to_keep: int = 0) -> LMOutput:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("device lost")
        return LMOutput(logits=20.0 * torch.nn.functional.one_hot((idx + 1) % 272, 272).float(), cache=cache)


def _completion_calls(engine: TorchEngine, model: NextByte, reqs: list[GenerationRequest]) -> list[int]:
    """The forward count at which each request's result was delivered."""
    done_at = [0] * len(reqs)
    futures = engine.submit(reqs)
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: done_at.__setitem__(i, model.calls))
    engine.drive(futures)
    return done_at


def test_freed_slots_are_refilled_only_when_continuous() -> None:
    reqs = [GenerationRequest(prompt_ids=(1,), max_new_tokens=n, temperature=0.0) for n in (8, 1, 1, 1)]
    model = NextByte()
    static = _completion_calls(TorchEngine(model, max_batch=2, continuous=False), model, reqs)
    assert static == [8, 1, 9, 9]  # the second wave waits for the long row
    model = NextByte()
    cont = _completion_calls(TorchEngine(model, max_batch=2), model, reqs)
    assert cont[2] < cont[0] and cont[3] < cont[0]  # the short ones took the freed slot meanwhile


def test_a_failed_step_fails_the_rows_in_flight_and_the_engine_recovers() -> None:
    engine = TorchEngine(NextByte(fail_at=3), max_batch=2)
    reqs = [GenerationRequest(prompt_ids=(1,), max_new_tokens=5, temperature=0.0) for _ in range(3)]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(reqs)
    (res,) = engine.generate([GenerationRequest(prompt_ids=(7,), max_new_tokens=2, temperature=0.0)])
    assert res.token_ids == (8, 9)


def test_concurrent_generate_calls_share_the_running_batch(policy: Policy) -> None:
    reqs = _mixed(6, CFG.vocab, temperature=0.0)
    alone = [TorchEngine(policy).generate([r])[0].token_ids for r in reqs]
    engine = TorchEngine(policy, max_batch=4)
    out: dict[int, tuple[int, ...]] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, engine.generate([reqs[i]])[0].token_ids))
               for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [out[i] for i in range(len(reqs))] == alone


def test_short_request_arriving_mid_decode_finishes_before_the_long_one() -> None:
    torch.manual_seed(0)
    model = Policy(PolicyConfig(vocab=272, d_model=32, n_layer=1, n_head=2, max_seq=256, n_experts=0, d_ff=32)).eval()
    short = GenerationRequest(prompt_ids=(5, 6, 7), max_new_tokens=3, temperature=0.0, request_id="short")
    long = GenerationRequest(prompt_ids=(1, 2), max_new_tokens=200, temperature=0.0, request_id="long")
    finished: list[str] = []
    results: dict[str, GenerationResult] = {}
    steps = 0

    def call(req: GenerationRequest) -> None:
        (results[req.request_id],) = engine.generate([req])
        finished.append(req.request_id)

    short_thread = threading.Thread(target=call, args=(short,))

    def hook() -> None:  # the long request is decoding: the short one arrives now, from another episode
        nonlocal steps
        steps += 1
        if steps == 3:
            short_thread.start()
        if steps < 150:
            time.sleep(0.001)  # keep the long one busy long enough to be overtaken on a slow machine

    inner = TorchEngine(model, max_batch=8, between_steps=hook)
    engine = BatchingEngine(inner, window_s=0.001)
    long_thread = threading.Thread(target=call, args=(long,))
    long_thread.start()
    long_thread.join(60)
    short_thread.join(60)
    assert finished == ["short", "long"]
    assert results["short"].token_ids == TorchEngine(model).generate([short])[0].token_ids
    assert results["long"].token_ids == TorchEngine(model).generate([long])[0].token_ids
    assert engine.batches == 2


def test_rejected_request_fails_its_flush_without_hanging() -> None:
    engine = BatchingEngine(TorchEngine(NextByte()), window_s=0.001)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([GenerationRequest(prompt_ids=(1,) * 250, max_new_tokens=10)])


def test_drive_refuses_futures_it_does_not_own() -> None:
    with pytest.raises(RuntimeError, match="not submitted"):
        TorchEngine(NextByte()).drive([Future()])
