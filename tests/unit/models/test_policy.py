"""The policy model: shapes, KV-cache equivalence, left padding, MoE routing, router replay, aux loss."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from rlbus.errors import ConfigError
from rlbus.models.policy import KVCache, MoE, Policy, PolicyConfig

CFG = PolicyConfig.tiny()


@pytest.fixture(scope="module")
def model() -> Policy:
    torch.manual_seed(0)
    return Policy(CFG).eval()


def _ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _param_count(c: PolicyConfig) -> int:
    # embeddings + lm_head (untied) + final norm; per layer: 2 norms, qkv + proj (4 d²), and either
    # router (d·E) + E SwiGLU experts (3·d·d_ff each) or one dense SwiGLU MLP.
    ffn = c.d_model * c.n_experts + c.n_experts * 3 * c.d_model * c.d_ff if c.moe else 3 * c.d_model * c.d_ff
    per_layer = 2 * c.d_model + 4 * c.d_model**2 + ffn
    return 2 * c.vocab * c.d_model + c.d_model + c.n_layer * per_layer


def test_presets_have_the_advertised_sizes() -> None:
    tiny = PolicyConfig.tiny()
    assert Policy(tiny).num_params() == _param_count(tiny)  # the formula is the model's...
    assert 0.5e6 < _param_count(tiny) < 2e6
    assert 80e6 < _param_count(PolicyConfig.bench()) < 120e6  # ...so the 95M model need not be built


def test_forward_shapes(model: Policy) -> None:
    out = model(_ids(2, 10))
    assert out.logits.shape == (2, 10, CFG.vocab)
    assert out.logits.dtype == torch.float32
    assert out.routed_experts is not None
    assert out.routed_experts.shape == (CFG.n_layer, 2, 10, CFG.top_k)
    assert int(out.routed_experts.min()) >= 0 and int(out.routed_experts.max()) < CFG.n_experts
    # top-k experts of a token are distinct
    e = out.routed_experts
    assert bool((e[..., 0] != e[..., 1]).all())
    assert out.aux_loss is not None and out.aux_loss.dim() == 0 and torch.isfinite(out.aux_loss)


def test_dense_config_has_no_routing() -> None:
    torch.manual_seed(0)
    dense = Policy(dataclasses.replace(CFG, n_experts=0))
    out = dense(_ids(1, 5))
    assert out.routed_experts is None and out.aux_loss is None
    with pytest.raises(ValueError, match="dense"):
        dense(_ids(1, 5), routed_experts=torch.zeros(CFG.n_layer, 1, 5, CFG.top_k, dtype=torch.long))


def test_incremental_decoding_matches_full_forward(model: Policy) -> None:
    ids = _ids(2, 12)
    full = model(ids).logits  # [2, 12, V]
    cache = model.new_cache(2, 16)
    steps = [model(ids[:, :5], cache=cache).logits]  # prefill 5
    for t in range(5, 12):  # then one token at a time
        steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert cache.pos == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_left_padded_row_matches_unpadded(model: Policy) -> None:
    ids = _ids(1, 6)
    alone = model(ids).logits[0]  # [6, V]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)  # [1, 9]: 3 pad slots first
    key_mask = torch.tensor([[False] * 3 + [True] * 6])
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5]])
    out = model(padded, positions=positions, key_mask=key_mask).logits[0, 3:]
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-4)


def test_cache_overflow_and_bad_mask_are_rejected(model: Policy) -> None:
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="slots"):
        model(_ids(1, 5), cache=cache)
    with pytest.raises(ValueError, match="key_mask"):
        model(_ids(1, 5), key_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError):
        model(_ids(1, 2), cache=object())
    assert isinstance(model.new_cache(1, 4), KVCache)


def test_replaying_own_experts_reproduces_the_forward(model: Policy) -> None:
    ids = _ids(2, 9)
    normal = model(ids)
    assert normal.routed_experts is not None
    replayed = model(ids, routed_experts=normal.routed_experts)
    assert torch.equal(replayed.logits, normal.logits)
    assert replayed.routed_experts is not None
    assert torch.equal(replayed.routed_experts, normal.routed_experts)


def test_replaying_other_experts_changes_output_but_reports_own_routing(model: Policy) -> None:
    ids = _ids(2, 9)
    normal = model(ids)
    assert normal.routed_experts is not None
    other = (normal.routed_experts + 1) % CFG.n_experts  # a different, still distinct, pair per token
    replayed = model(ids, routed_experts=other)
    assert not torch.allclose(replayed.logits, normal.logits, atol=1e-4)
    assert replayed.routed_experts is not None
    # Layer 0 routes from the embeddings alone, so its own top-k is unchanged by replay: flips are measurable.
    assert torch.equal(replayed.routed_experts[0], normal.routed_experts[0])
    assert not torch.equal(replayed.routed_experts[0], other[0])


def test_replay_shape_and_range_are_checked(model: Policy) -> None:
    ids = _ids(1, 4)
    with pytest.raises(ValueError, match=r"\[L, B, T, k\]"):
        model(ids, routed_experts=torch.zeros(CFG.n_layer, 1, 3, CFG.top_k, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must be in"):
        model(ids, routed_experts=torch.full((CFG.n_layer, 1, 4, CFG.top_k), CFG.n_experts))


def test_router_gets_gradient_under_replay(model: Policy) -> None:
    ids = _ids(2, 6)
    routed = model(ids).routed_experts
    model.zero_grad()
    out = model(ids, routed_experts=routed)
    assert out.aux_loss is not None
    (out.logits.logsumexp(-1).mean() + out.aux_loss).backward()
    block = model.blocks[0]
    assert isinstance(block.ffn, MoE)
    grad = block.ffn.router.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
    model.zero_grad()


def test_switch_aux_loss_is_one_at_a_uniform_router() -> None:
    # Zero router weights: softmax = uniform, P_e = 1/E = 0.25 for every e. Each token sends its k = 2
    # slots to two distinct experts, so Σ_e f_e = 1 whatever the tie-break picks, and
    # aux = E · Σ_e f_e · P_e = 4 · 0.25 · Σ_e f_e = 1. The returned loss is coef · 1 = 0.01.
    torch.manual_seed(0)
    m = Policy(CFG)
    with torch.no_grad():
        for block in m.blocks:
            assert isinstance(block.ffn, MoE)
            block.ffn.router.weight.zero_()
    out = m(_ids(2, 7))
    assert out.aux_loss is not None
    assert float(out.aux_loss.detach()) == pytest.approx(CFG.aux_loss_coef * 1.0, rel=1e-6)


def test_aux_loss_ignores_padding_tokens(model: Policy) -> None:
    ids = _ids(1, 6)
    alone = model(ids).aux_loss
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], dim=1)
    key_mask = torch.tensor([[False, False] + [True] * 6])
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5]])
    assert alone is not None
    torch.testing.assert_close(model(padded, positions=positions, key_mask=key_mask).aux_loss, alone)


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_head", 3), ("top_k", 5), ("n_experts", -1), ("d_model", 0), ("aux_loss_coef", -1.0)],
)
def test_config_validation_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(CFG, **{field: value})
    assert info.value.field == field
