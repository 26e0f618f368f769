"""The sampling distribution π' (temperature → top-k → top-p) with hand-worked values, the logits mask, and
the counter-based sampler."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlbus.engines.sampling import SamplingParams, _mix32, counter_uniform, draw, processed_logprobs, row_key, sample

# Base distribution p = [0.1, 0.2, 0.3, 0.4] (logits = log p, so softmax(logits) = p at temperature 1).
LOGITS = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
NEG_INF = float("-inf")


def _keys(seeds: Any) -> torch.Tensor:
    return torch.tensor([row_key(s) for s in seeds])


def _pi(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    lp = processed_logprobs(LOGITS, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    return lp[0].exp()


def test_no_processing_is_the_softmax() -> None:
    torch.testing.assert_close(_pi(), torch.tensor([0.1, 0.2, 0.3, 0.4]))


def test_temperature_two_takes_square_roots() -> None:
    # softmax(log p / 2) ∝ sqrt(p): sqrt([.1,.2,.3,.4]) = [.3162, .4472, .5477, .6325], sum 1.9436
    expected = torch.tensor([0.1, 0.2, 0.3, 0.4]).sqrt()
    torch.testing.assert_close(_pi(temperature=2.0), expected / expected.sum())


def test_top_k_two_keeps_the_two_largest_renormalised() -> None:
    # keep {0.3, 0.4}: 0.3 / 0.7 = 3/7, 0.4 / 0.7 = 4/7
    torch.testing.assert_close(_pi(top_k=2), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # sorted 0.4, 0.3, 0.2, 0.1; mass before each: 0, 0.4, 0.7, 0.9.
    # p = 0.5: ranks with mass-before < 0.5 → {0.4, 0.3} → [3/7, 4/7]; p = 0.35: only 0.4 → point mass.
    torch.testing.assert_close(_pi(top_p=0.5), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))
    torch.testing.assert_close(_pi(top_p=0.35), torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    # top-k 3 → [.2,.3,.4]/.9 = [.222, .333, .444]; mass before: 0, .444, .778.
    # p = 0.7: keep .444 and .333 (0.444 < 0.7), drop .222 (0.778 ≥ 0.7) → [3/7, 4/7].
    torch.testing.assert_close(_pi(top_k=3, top_p=0.7), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))


def test_greedy_is_a_point_mass_at_the_argmax() -> None:
    lp = processed_logprobs(LOGITS, torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]))[0]
    assert lp.tolist() == [NEG_INF, NEG_INF, NEG_INF, 0.0]


def test_rows_use_their_own_parameters() -> None:
    logits = LOGITS.expand(2, 4)
    lp = processed_logprobs(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(lp[0].exp(), torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert lp[1].tolist() == [NEG_INF, NEG_INF, NEG_INF, 0.0]


def test_sampler_follows_the_distribution_and_never_leaves_its_support() -> None:
    n = 4000
    lp = processed_logprobs(
        LOGITS.expand(n, 4), torch.ones(n), torch.full((n,), 2), torch.ones(n)
    )  # every row: [0, 0, 3/7, 4/7]
    draws = sample(lp, _keys(range(n)), torch.zeros(n, dtype=torch.long))  # n seeds, first token each
    assert set(draws.tolist()) <= {2, 3}
    freq = float((draws == 3).float().mean())
    assert abs(freq - 4 / 7) < 4 * math.sqrt((4 / 7) * (3 / 7) / n)  # within 4 standard errors
    # one seed along its counter is a stream with the same law
    along = sample(lp, _keys([7] * n), torch.arange(n))
    assert abs(float((along == 3).float().mean()) - 4 / 7) < 4 * math.sqrt((4 / 7) * (3 / 7) / n)


def test_sampler_is_a_pure_function_of_seed_and_counter() -> None:
    lp = processed_logprobs(torch.randn(8, 50), torch.ones(8), torch.zeros(8, dtype=torch.long), torch.ones(8))
    seeds, counters = _keys(range(0, 8_000_024, 1_000_003)), torch.arange(8) + 5
    a = sample(lp, seeds, counters)
    assert torch.equal(a, sample(lp, seeds, counters))
    # a row's draw does not depend on the rows beside it, nor on their order
    perm = torch.tensor([3, 1, 7, 0, 2, 6, 5, 4])
    assert torch.equal(sample(lp[perm], seeds[perm], counters[perm]), a[perm])
    assert torch.equal(sample(lp[2:3], seeds[2:3], counters[2:3]), a[2:3])


def test_counter_uniforms_are_uniform_and_independent() -> None:
    n = 100_000
    u = counter_uniform(_keys([42] * n), torch.arange(n))  # one stream
    v = counter_uniform(_keys(range(-n // 2, n // 2)), torch.zeros(n, dtype=torch.long))  # first draw of many seeds
    for x in (u, v):
        assert 0 < float(x.min()) and float(x.max()) < 1
        assert abs(float(x.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / n)
        counts = torch.histc(x.float(), bins=100, min=0, max=1)
        chi2 = float(((counts - n / 100) ** 2 / (n / 100)).sum())
        assert chi2 < 99 + 5 * math.sqrt(2 * 99)  # 99 degrees of freedom, 5 standard deviations
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.02  # successive draws
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.02  # streams


def test_row_keys_take_any_python_seed_and_the_hash_is_exact() -> None:
    keys = [row_key(s) for s in (0, 1, 5, -1, 2**63, 2**64 + 5, 10**30)]
    assert all(0 <= k < 2**32 for k in keys) and len(set(keys[:5])) == 5 and keys[2] == keys[5]  # mod 2^64
    x = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    reference = []
    for v in x.tolist():  # lowbias32 in Python's exact integers
        v ^= v >> 16
        v = (v * 0x7FEB352D) % 2**32
        v ^= v >> 15
        v = (v * 0x846CA68B) % 2**32
        reference.append(v ^ (v >> 16))
    assert _mix32(x).tolist() == reference


def test_draw_advances_each_rows_counter_and_returns_exact_logprobs() -> None:
    logits = torch.randn(3, 40)
    params = SamplingParams.of([(1.0, 0, 1.0, 1, 0), (0.5, 5, 0.9, 2, 4), (0.0, 0, 1.0, 3, 9)], "cpu")
    assert params.truncate
    tokens, token_logp, logp = draw(logits, params)
    assert params.counter.tolist() == [1, 5, 10]
    torch.testing.assert_close(token_logp, logp.gather(1, tokens[:, None])[:, 0])
    assert int(tokens[2]) == int(logits[2].argmax()) and float(token_logp[2]) == 0.0


def test_the_logits_mask_restricts_and_renormalises_before_truncation() -> None:
    """The constrained-decoding hook: a masked token is impossible; the rest renormalise; top-k then counts
    only the allowed tokens; an all-True row is the unconstrained distribution."""
    allowed = torch.tensor([[True, True, True, False], [True, True, True, True]])
    logits = LOGITS.expand(2, 4)
    lp = processed_logprobs(logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2), allowed=allowed)
    torch.testing.assert_close(lp[0].exp(), torch.tensor([1 / 6, 2 / 6, 3 / 6, 0.0]))
    torch.testing.assert_close(lp[1].exp(), torch.tensor([0.1, 0.2, 0.3, 0.4]))
    lp = processed_logprobs(logits, torch.ones(2), torch.tensor([2, 2]), torch.ones(2), allowed=allowed)
    torch.testing.assert_close(lp[0].exp(), torch.tensor([0.0, 2 / 5, 3 / 5, 0.0]))
    draws = sample(lp[:1].expand(500, 4), _keys(range(500)), torch.zeros(500, dtype=torch.long))
    assert set(draws.tolist()) == {1, 2}


def test_the_untruncated_fast_path_is_the_full_computation() -> None:
    """A batch with no greedy, top-k or top-p row skips the sort; it must equal the general path (which a
    single truncating row forces for the whole batch)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    t = torch.tensor([1.0, 0.7, 1.3, 0.5])
    fast = processed_logprobs(logits, t, torch.zeros(4, dtype=torch.long), torch.ones(4), truncate=False)
    forced = processed_logprobs(torch.cat([logits, logits[:1]]), torch.cat([t, t[:1]]),
                                torch.tensor([0, 0, 0, 0, 5]), torch.ones(5))[:4]
    assert torch.allclose(fast, forced, atol=1e-6) and torch.allclose(fast.exp().sum(-1), torch.ones(4))
