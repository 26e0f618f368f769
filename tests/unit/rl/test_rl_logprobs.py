"""Trainer-side log-probs of sampled tokens."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.logprobs import sampled_token_logprobs


def test_hand_worked_values() -> None:
    # logits log(0.1, 0.2, 0.3, 0.4): τ = 1 → log p; τ = 2 → p ∝ sqrt(p): token 3 gets sqrt(.4) / Σ sqrt(p)
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().expand(1, 2, 4)
    tokens = torch.tensor([[3, 0]])
    lp = sampled_token_logprobs(logits, tokens)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.4), math.log(0.1)]]))
    roots = [math.sqrt(p) for p in (0.1, 0.2, 0.3, 0.4)]
    lp2 = sampled_token_logprobs(logits, tokens, temperature=2.0)
    torch.testing.assert_close(lp2[0, 0], torch.tensor(math.log(roots[3] / sum(roots))))


def test_matches_the_engine_for_an_untruncated_rollout() -> None:
    from rlbus.engines.sampling import processed_logprobs

    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([1, 5, 9])
    engine = processed_logprobs(logits, torch.full((3,), 0.7), torch.zeros(3, dtype=torch.long), torch.ones(3))
    expected = engine.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(sampled_token_logprobs(logits[None], tokens[None], temperature=0.7)[0], expected)


def test_errors() -> None:
    with pytest.raises(ValueError):
        sampled_token_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError):
        sampled_token_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))
