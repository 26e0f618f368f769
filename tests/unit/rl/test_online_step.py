"""`online_step`: single samples with given advantages go through exactly the GRPO step's objective (same
gradient as a group whose group advantages are those numbers), with its own staleness bound and the
same IS correction."""

from __future__ import annotations

import pytest
import torch

from rlbus.models.policy import Policy, PolicyConfig
from rlbus.rl.online import OnlineBaseline
from rlbus.training.batch import Group, Sample
from rlbus.training.step import GRPOConfig, grpo_step, online_step

CFG = PolicyConfig(vocab=272, d_model=32, n_layer=2, n_head=2, max_seq=64, n_experts=4, top_k=2, d_ff=32)


def sample(g: torch.Generator, prompt: int, completion: int, *, version: int = 0) -> Sample:
    T = prompt + completion
    mask = torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(completion, dtype=torch.bool)])
    return Sample(token_ids=torch.randint(0, 256, (T,), generator=g), loss_mask=mask,
                  logprobs=torch.where(mask, -5.7 + 0.2 * torch.rand(T, generator=g), 0.0),  # near log(1/272)
                  versions=torch.where(mask, version, -1), routed_experts=None)


def grads_after(step: str, samples: tuple[Sample, ...], config: GRPOConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Policy(CFG)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradient is the step's own, weights stay
    if step == "grpo":  # rewards [1, 0, 0.5] → group advantages [0.5, −0.5, 0]
        grpo_step(model, sgd, [Group(samples=samples, rewards=torch.tensor([1.0, 0.0, 0.5]))], config=config,
                  version=0)
    else:
        online_step(model, sgd, samples, torch.tensor([0.5, -0.5, 0.0]), torch.tensor([1.0, 0.0, 0.5]),
                    config=config, version=0, max_staleness=0)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("is_mode", ["tis", "mis", "none"])
def test_online_step_is_the_grpo_objective_with_given_advantages(is_mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    samples = (sample(g, 3, 5), sample(g, 4, 2), sample(g, 2, 6))
    config = GRPOConfig(normalize_std=False, is_mode=is_mode, aux_loss=False)  # type: ignore[arg-type]
    grpo, online = grads_after("grpo", samples, config), grads_after("online", samples, config)
    assert grpo.keys() == online.keys() and grpo
    for name in grpo:
        torch.testing.assert_close(online[name], grpo[name], rtol=1e-5, atol=1e-7)
    assert any(float(t.abs().sum()) > 0 for t in online.values())


def test_online_step_drops_by_its_own_staleness_bound() -> None:
    g = torch.Generator().manual_seed(2)
    samples = [sample(g, 3, 4, version=2), sample(g, 3, 4, version=9)]
    torch.manual_seed(0)
    model = Policy(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the trainer is at v10; GRPO's bound (config) would drop both, the online bound of 4 keeps the second
    metrics = online_step(model, opt, samples, torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]),
                          config=GRPOConfig(max_staleness=0), version=10, max_staleness=4)
    assert (metrics.stale_dropped, metrics.samples, metrics.optimizer_steps) == (1, 2, 1)
    assert metrics.staleness == {1: 1, 8: 1}


def test_online_step_checks_shapes() -> None:
    g = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="shape"):
        online_step(Policy(CFG), torch.optim.SGD(Policy(CFG).parameters(), lr=0.1), [sample(g, 2, 2)],
                    torch.tensor([1.0, 2.0]), torch.tensor([1.0]), config=GRPOConfig(), version=0, max_staleness=1)


def test_zero_advantage_means_no_gradient() -> None:
    """A key whose baseline equals its reward teaches nothing: the EMA at 1.0 against a thumbs-up."""
    base = OnlineBaseline(estimator="ema", alpha=1.0, min_count=0)
    base.advantages(["k"], [1.0])
    (adv,) = base.advantages(["k"], [1.0])
    assert adv == 0.0
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(0)
    model = Policy(CFG)
    online_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [sample(g, 3, 4)], torch.tensor([adv]),
                torch.tensor([1.0]), config=GRPOConfig(aux_loss=False), version=0, max_staleness=1)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters() if p.grad is not None)
