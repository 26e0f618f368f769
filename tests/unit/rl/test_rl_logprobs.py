"""Trainer-side log-probs of sampled tokens."""

from __future__ import annotations

import math

import pytest
import torch

from rlbus.rl.logprobs import chunked_token_logprobs, sampled_token_logprobs


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


def projection_case(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """hidden [3, 7, 8], LM head [50, 8], targets [3, 7], per-row temperatures and a ragged mask (M = 13)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    temperature = torch.tensor([1.0, 0.7, 1.3])
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 2:], mask[1, 5:], mask[2, 1:7] = True, True, True
    return hidden, weight, targets, temperature, mask


@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])
def test_chunked_equals_full_logits_in_value_and_gradient(chunk: int) -> None:
    hidden, weight, targets, temperature, mask = projection_case()
    logits = (hidden @ weight.T) / temperature[:, None, None]  # [B, S, V]
    full = sampled_token_logprobs(logits, targets) * mask  # [B, S]
    (full * torch.arange(21.0).view(3, 7)).sum().backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got = chunked_token_logprobs(hidden, weight, targets, temperature, mask=mask, chunk_tokens=chunk)
    torch.testing.assert_close(got, full)
    assert bool((got[~mask] == 0).all())
    (got * torch.arange(21.0).view(3, 7)).sum().backward()
    torch.testing.assert_close(hidden.grad, want[0])
    torch.testing.assert_close(weight.grad, want[1])


def test_chunked_keeps_no_logits_for_backward() -> None:
    hidden, weight, targets, temperature, mask = projection_case()
    M, V, D = int(mask.sum()), weight.shape[0], weight.shape[1]
    saved: dict[int, int] = {}  # storage → elements: a chunk's view of h or W is not a new tensor

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_logprobs(hidden, weight, targets, temperature, mask=mask, chunk_tokens=4).sum().backward()
    assert max(saved.values()) < M * V
    # what backward keeps: W, the gathered [M, D] hidden states and a few [M] index/target/temperature vectors
    assert sum(saved.values()) <= (V + M) * D + 4 * M

    saved.clear()  # the full-logits reference does keep [B·S, V]: the hook sees what it is meant to see
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sampled_token_logprobs(hidden @ weight.T, targets).sum().backward()
    assert max(saved.values()) >= hidden.shape[0] * hidden.shape[1] * V


def test_chunked_with_nothing_to_score_is_zero_and_differentiable() -> None:
    hidden, weight, targets, temperature, _ = projection_case()
    got = chunked_token_logprobs(hidden, weight, targets, temperature, mask=torch.zeros(3, 7, dtype=torch.bool),
                                 chunk_tokens=4)
    assert bool((got == 0).all())
    got.sum().backward()
    assert hidden.grad is not None and bool((hidden.grad == 0).all())


def test_chunked_errors() -> None:
    hidden, weight, targets, temperature, _ = projection_case()
    with pytest.raises(ValueError, match="line up"):
        chunked_token_logprobs(hidden, weight, targets[:, :-1], temperature, chunk_tokens=4)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, weight, targets, temperature, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight, targets, torch.tensor([1.0, 0.0, 1.0]), chunk_tokens=4)
