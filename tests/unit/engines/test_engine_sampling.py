"""The sampling distribution π' (temperature → top-k → top-p) with hand-worked values, and the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.engines.sampling import processed_logprobs, sample

# Base distribution p = [0.1, 0.2, 0.3, 0.4] (logits = log p, so softmax(logits) = p at temperature 1).
LOGITS = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
NEG_INF = float("-inf")


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
    g = torch.Generator().manual_seed(0)
    draws = sample(lp, [g] * n)
    assert set(draws.tolist()) <= {2, 3}
    freq = float((draws == 3).float().mean())
    assert abs(freq - 4 / 7) < 4 * math.sqrt((4 / 7) * (3 / 7) / n)  # within 4 standard errors


def test_sampler_is_reproducible_and_needs_one_generator_per_row() -> None:
    lp = processed_logprobs(LOGITS.expand(8, 4), torch.ones(8), torch.zeros(8, dtype=torch.long), torch.ones(8))
    a = sample(lp, [torch.Generator().manual_seed(i) for i in range(8)])
    b = sample(lp, [torch.Generator().manual_seed(i) for i in range(8)])
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="one generator per row"):
        sample(lp, [torch.Generator()])


def test_the_untruncated_fast_path_is_the_full_computation() -> None:
    """A batch with no greedy, top-k or top-p row skips the sort; it must equal the general path (which a
    single truncating row forces for the whole batch)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    t = torch.tensor([1.0, 0.7, 1.3, 0.5])
    fast = processed_logprobs(logits, t, torch.zeros(4, dtype=torch.long), torch.ones(4))
    forced = processed_logprobs(torch.cat([logits, logits[:1]]), torch.cat([t, t[:1]]),
                                torch.tensor([0, 0, 0, 0, 5]), torch.ones(5))[:4]
    assert torch.allclose(fast, forced, atol=1e-6) and torch.allclose(fast.exp().sum(-1), torch.ones(4))
