"""The torch engine's prefix cache: a turn that extends a finished row computes what a full prefill would.

Both cache types (the in-house preallocated `KVCache` of the MoE `Policy`, and transformers' `DynamicCache`
of a random Llama) are checked against the same engine with the cache off: the same seeded samples, their
log-probs equal up to float rounding, routed experts cover every input token, and the reuse is counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rlbus.engines.base import GenerationRequest, GenerationResult
from rlbus.engines.prefix import Prefix, PrefixCache
from rlbus.engines.torch_engine import TorchEngine
from rlbus.models.policy import Policy, PolicyConfig

CFG = PolicyConfig.tiny()  # MoE: routed experts are recorded, so the cached path must carry them too
assert CFG.moe


def _vocab(name: str) -> int:
    return CFG.vocab if name == "policy" else 512


def _ids(n: int, vocab: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(1, vocab, (n,), generator=g).tolist())


def _turns(engine: TorchEngine, episodes: int, turns: int, vocab: int) -> list[list[GenerationResult]]:
    """Agent-shaped traffic: each episode's next prompt is its last prompt + completion + an 'observation';
    every turn of all episodes is submitted together (they share the engine's batch)."""
    contexts = [_ids(40 + 7 * e, vocab, seed=e) for e in range(episodes)]
    out: list[list[GenerationResult]] = [[] for _ in range(episodes)]
    for t in range(turns):
        # sampled at T = 1 with a seed per request: the log-probs of sampled tokens are sensitive to every key
        reqs = [GenerationRequest(prompt_ids=c, max_new_tokens=3 + (e + t) % 5, seed=100 * e + t, request_id=f"{e}.{t}")
                for e, c in enumerate(contexts)]  # fmt: skip
        for e, res in enumerate(engine.generate(reqs)):
            out[e].append(res)
            contexts[e] = (*contexts[e], *res.token_ids, *_ids(5 + t, vocab, seed=100 * e + t))
    return out


@pytest.mark.parametrize("model_name", ["policy", "llama"])
def test_cached_turns_equal_full_prefills(model_name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(model_name)
    vocab = _vocab(model_name)
    plain = _turns(TorchEngine(model, max_batch=4), episodes=5, turns=4, vocab=vocab)
    engine = TorchEngine(model, max_batch=4, prefix_cache_tokens=100_000)
    cached = _turns(engine, episodes=5, turns=4, vocab=vocab)
    for a_ep, b_ep in zip(plain, cached, strict=True):
        for t, (a, b) in enumerate(zip(a_ep, b_ep, strict=True)):
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
            assert a.extra["cached_prompt_tokens"] == 0
            if t == 0:
                assert b.extra["cached_prompt_tokens"] == 0
            else:  # the previous turn's prompt and every token it fed (all sampled but the last)
                previous = b_ep[t - 1]
                assert b.extra["cached_prompt_tokens"] == len(previous.prompt_ids) + len(previous.token_ids) - 1
            if a.routed_experts is not None:
                assert b.routed_experts is not None and b.routed_experts.shape == a.routed_experts.shape
                # the same tokens routed to the same experts (router ties aside, which random weights do not make)
                assert torch.equal(a.routed_experts, b.routed_experts)
    stats = engine.prefix_stats
    assert stats["hits"] == 5 * 3 and stats["lookups"] == 5 * 4
    assert stats["reused_tokens"] > stats["prefilled_tokens"] > 0  # most of every later turn was reused


def test_cached_prefix_is_not_reused_across_a_weight_version(policy: Policy) -> None:
    engine = TorchEngine(policy, prefix_cache_tokens=10_000)
    first = engine.generate([GenerationRequest(prompt_ids=_ids(60, CFG.vocab, 1), max_new_tokens=4)])[0]
    follow = (*first.prompt_ids, *first.token_ids, 7, 8)
    engine.policy_version = 1  # what a swap does (the weights changed: old keys/values are not reused)
    again = engine.generate([GenerationRequest(prompt_ids=follow, max_new_tokens=2)])[0]
    assert again.extra["cached_prompt_tokens"] == 0
    assert engine.prefix_stats["stale"] == 1 and engine.prefix_stats["hits"] == 0
    # the row just computed under version 1 is kept: its continuation hits
    third = engine.generate([GenerationRequest(prompt_ids=(*follow, *again.token_ids, 9), max_new_tokens=2)])[0]
    assert third.extra["cached_prompt_tokens"] == len(follow) + len(again.token_ids) - 1


def test_rows_that_share_one_prefix_all_reuse_it(policy: Policy) -> None:
    """A GRPO group: G rows of one prompt after an earlier turn; every one starts from the kept row."""
    engine = TorchEngine(policy, prefix_cache_tokens=10_000)
    base = engine.generate([GenerationRequest(prompt_ids=_ids(50, CFG.vocab, 3), max_new_tokens=3)])[0]
    prompt = (*base.prompt_ids, *base.token_ids, 11, 12, 13)
    reqs = [GenerationRequest(prompt_ids=prompt, max_new_tokens=2 + s, temperature=0.0) for s in range(4)]
    group = engine.generate(reqs)
    assert [r.extra["cached_prompt_tokens"] for r in group] == [52] * 4
    alone = TorchEngine(policy).generate(reqs)
    assert [r.token_ids for r in group] == [r.token_ids for r in alone]


def test_store_keeps_the_longest_and_evicts_least_recently_used() -> None:
    def entry(ids: list[int], version: int = 0) -> Prefix:
        return Prefix(ids=np.asarray(ids, dtype=np.int64), slots=[], version=version)

    store = PrefixCache(max_tokens=100, min_tokens=2)
    store.add(entry(list(range(40))))
    store.add(entry(list(range(50))))  # covers the first: it is dropped
    assert len(store) == 1 and store.tokens == 50
    store.add(entry([7] * 45))
    assert len(store) == 2 and store.tokens == 95
    hit = store.match(np.asarray([*range(30), 99]), version=0)
    assert hit is not None and hit[1] == 30
    store.add(entry([8] * 20))  # 115 > 100: the least recently used ([7] * 45, never matched) goes
    assert store.tokens == 70 and store.stats.evicted == 1
    assert store.match(np.asarray([7] * 10), version=0) is None
    # a full match still leaves one prompt token to feed
    hit = store.match(np.asarray(list(range(50))), version=0)
    assert hit is not None and hit[1] == 49
    assert store.match(np.asarray(list(range(50))), version=1) is None and store.stats.stale == 2


def test_off_by_default_and_rejects_a_negative_budget(policy: Policy) -> None:
    engine: Any = TorchEngine(policy)
    assert engine.prefix_cache is None and engine.prefix_stats["hits"] == 0
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        TorchEngine(policy, prefix_cache_tokens=-1)
