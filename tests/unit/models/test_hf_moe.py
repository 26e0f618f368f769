"""Router recording and replay on tiny random HF MoE models built from config (no weights, no hub)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the HF MoE tests need the 'transformers' package")

from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from rlbus.engines.base import GenerationRequest
from rlbus.engines.torch_engine import TorchEngine
from rlbus.errors import ConfigError
from rlbus.models.hf import HFCausalLM
from rlbus.models.hf_moe import RouterTap, switch_aux

VOCAB, E, K = 256, 8, 2
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts_per_tok=K, max_position_embeddings=128,
)  # fmt: skip


def qwen3_moe(**overrides: Any) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=E, decoder_sparse_step=1,
                          mlp_only_layers=[], **overrides)


@pytest.fixture(scope="module")
def lm() -> HFCausalLM:
    return HFCausalLM.from_config(qwen3_moe(), seed=0)


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def gates(model: HFCausalLM) -> list[torch.nn.Module]:
    assert model.router is not None
    return model.router.routers


def capture(modules: list[torch.nn.Module], pick: Any) -> tuple[list[Any], list[Any]]:
    """Pre-hooks storing ``pick(args)`` of every call; returns (captured, handles)."""
    seen: list[Any] = []
    handles = [m.register_forward_pre_hook(lambda _m, args: seen.append(pick(args))) for m in modules]
    return seen, handles


def test_records_each_layers_own_top_k(lm: HFCausalLM) -> None:
    x = ids(2, 6)
    inputs, handles = capture(gates(lm), lambda args: args[0].detach())  # [N, C] per MoE layer
    try:
        out = lm.forward(x)
    finally:
        for h in handles:
            h.remove()
    assert out.routed_experts is not None and out.routed_experts.dtype == torch.int64
    assert tuple(out.routed_experts.shape) == (2, 2, 6, K)  # [L, B, T, k]
    for layer, (gate, hidden) in enumerate(zip(gates(lm), inputs, strict=True)):
        expected = F.linear(hidden, gate.weight).softmax(-1).topk(K, dim=-1).indices  # [N, k]
        assert torch.equal(out.routed_experts[layer].reshape(-1, K), expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_norm", "olmoe", "mixtral"])
def test_replaying_the_recorded_experts_reproduces_the_logits_exactly(family: str) -> None:
    configs = {
        "qwen3_moe": lambda: qwen3_moe(),
        "qwen3_moe_norm": lambda: qwen3_moe(norm_topk_prob=True),
        "olmoe": lambda: OlmoeConfig(**SHAPE, num_experts=E),
        "mixtral": lambda: MixtralConfig(**SHAPE, num_local_experts=E),
    }
    model = HFCausalLM.from_config(configs[family](), seed=0)
    x = ids(2, 7)
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[1, :3] = False  # a left-padded row, as the engine batches
    with torch.no_grad():
        own = model.forward(x, key_mask=key_mask)
        replayed = model.forward(x, key_mask=key_mask, routed_experts=own.routed_experts)
    assert torch.equal(replayed.logits, own.logits)
    assert replayed.routed_experts is not None and own.routed_experts is not None
    assert torch.equal(replayed.routed_experts, own.routed_experts)
    assert replayed.aux_loss is not None and own.aux_loss is not None
    assert torch.equal(replayed.aux_loss, own.aux_loss)


def test_replaying_other_experts_routes_there_and_still_records_the_routers_choice(lm: HFCausalLM) -> None:
    x = ids(2, 6)
    with torch.no_grad():
        own = lm.forward(x)
        assert own.routed_experts is not None
        other = (own.routed_experts + 3) % E  # [L, B, T, k] a different, still distinct, pair per token
        used, handles = capture([g for g in lm.hf.modules() if type(g).__name__.endswith("Experts")],
                                lambda args: args[1].clone())  # top_k_index [N, k] handed to the experts
        try:
            replayed = lm.forward(x, routed_experts=other)
        finally:
            for h in handles:
                h.remove()
    assert not torch.allclose(replayed.logits, own.logits)
    assert torch.equal(torch.stack(used).view_as(other), other)  # the experts ran on the replayed ids
    assert replayed.routed_experts is not None
    assert torch.equal(replayed.routed_experts[0], own.routed_experts[0])  # layer 0's input is unchanged


def test_replay_keeps_router_gradients(lm: HFCausalLM) -> None:
    x = ids(2, 6)
    with torch.no_grad():
        recorded = lm.forward(x).routed_experts
    lm.zero_grad()
    out = lm.forward(x, routed_experts=recorded)
    out.logits.logsumexp(-1).mean().backward()
    for gate in gates(lm):
        assert gate.weight.grad is not None and bool(gate.weight.grad.abs().sum() > 0)
    lm.zero_grad()


@pytest.mark.parametrize("replay", [False, True])
def test_gradient_checkpointing_recomputes_the_same_routing(replay: bool) -> None:
    model = HFCausalLM.from_config(qwen3_moe(), seed=0)
    x = ids(2, 6)
    with torch.no_grad():
        own = model.forward(x).routed_experts
        assert own is not None
    other = (own + 1) % E if replay else None
    grads = []
    model.train()
    for checkpointing in (False, True):
        model.set_gradient_checkpointing(checkpointing)
        model.zero_grad()
        feats = model.features(x, routed_experts=other)
        assert feats.aux_loss is not None
        (feats.hidden.square().mean() + feats.aux_loss).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.set_gradient_checkpointing(False)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def test_aux_loss_is_the_switch_loss_over_real_tokens(lm: HFCausalLM) -> None:
    x = ids(2, 6)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[0, 4:] = False  # right padding, as the trainer packs
    other_pad = x.clone()
    other_pad[0, 4:] = (x[0, 4:] + 1) % VOCAB
    with torch.no_grad():
        a = lm.features(x, key_mask=key_mask)
        b = lm.features(other_pad, key_mask=key_mask)
        c = lm.features(other_pad)
    assert a.aux_loss is not None and b.aux_loss is not None and c.aux_loss is not None
    torch.testing.assert_close(a.aux_loss, b.aux_loss)  # what sits at padding does not count
    assert not torch.allclose(a.aux_loss, c.aux_loss)
    # Hand-worked: uniform router → P_e = 1/E, Σ f_e = 1, so E · Σ f_e P_e = 1 whatever is chosen.
    chosen = torch.tensor([[0, 1], [0, 1], [2, 3]])
    assert switch_aux(torch.zeros(3, 4), chosen, None, 4).item() == pytest.approx(1.0)
    # Two tokens, both to experts {0, 1} of 2, router sure of expert 0 (P = [1, 0]): f = [.5, .5] → 2 · .5 = 1;
    # masking the second token (routed to {0, 1} too) changes nothing; an unmasked third to {1, 1} would.
    logits = torch.tensor([[50.0, 0.0], [50.0, 0.0], [50.0, 0.0]])
    both = torch.tensor([[0, 1], [0, 1], [1, 1]])
    mask = torch.tensor([True, True, False])
    assert switch_aux(logits, both, mask, 2).item() == pytest.approx(1.0)
    assert switch_aux(logits, both, None, 2).item() == pytest.approx(2 * (2 / 6 + 0 * 4 / 6))


def test_engine_records_and_trainer_replays_with_zero_flips(lm: HFCausalLM) -> None:
    engine = TorchEngine(lm, seed=0)
    prompts = [tuple(ids(1, n, seed=n)[0].tolist()) for n in (3, 6)]
    results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=5, temperature=1.0) for p in prompts])
    rows = [(list(r.prompt_ids) + list(r.token_ids))[:-1] for r in results]  # the inputs fed to the model
    S = max(len(r) for r in rows)
    inputs = torch.zeros(len(rows), S, dtype=torch.long)  # [B, S] right padded
    key_mask = torch.zeros(len(rows), S, dtype=torch.bool)  # [B, S]
    routed = torch.arange(K).expand(2, len(rows), S, K).clone()  # [L, B, S, k] padding: 0..k-1
    for b, (row, r) in enumerate(zip(rows, results, strict=True)):
        assert r.routed_experts is not None and tuple(r.routed_experts.shape) == (2, len(row), K)
        inputs[b, : len(row)] = torch.tensor(row)
        key_mask[b, : len(row)] = True
        routed[:, b, : len(row)] = r.routed_experts.long()
    used, handles = capture([g for g in lm.hf.modules() if type(g).__name__.endswith("Experts")],
                            lambda args: args[1].clone())
    try:
        with torch.no_grad():
            feats = lm.features(inputs, key_mask=key_mask, routed_experts=routed)
    finally:
        for h in handles:
            h.remove()
    assert feats.routed_experts is not None
    used_experts = torch.stack(used).view_as(routed)  # [L, B, S, k] what the experts actually ran
    real = key_mask[None, :, :, None].expand_as(routed)
    assert torch.equal(used_experts[real], routed[real])  # zero flips against the replayed record
    # The same fp32 model on both sides: the trainer's own router agrees with the engine's record too.
    assert torch.equal(feats.routed_experts[real], routed[real])


def test_a_deep_copy_records_through_its_own_tap(lm: HFCausalLM) -> None:
    twin = copy.deepcopy(lm).to(torch.bfloat16)  # how a bench makes its bf16 engine copy
    assert twin.router is not None and twin.router is not lm.router
    x = ids(1, 5)
    with torch.no_grad():
        mine, theirs = lm.forward(x).routed_experts, twin.forward(x).routed_experts
    assert mine is not None and theirs is not None and mine.shape == theirs.shape


def test_dense_model_has_no_tap_and_unknown_routers_are_refused() -> None:
    class FancySigmoidRouter(torch.nn.Module):
        pass

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = FancySigmoidRouter()

    assert RouterTap.attach(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ConfigError, match="FancySigmoidRouter"):
        RouterTap.attach(Toy())


def test_replay_shape_is_checked(lm: HFCausalLM) -> None:
    with pytest.raises(ValueError, match="L = 2"):
        lm.forward(ids(1, 4), routed_experts=torch.zeros(3, 1, 4, K, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        lm.forward(ids(1, 4), routed_experts=torch.zeros(2, 1, 5, K, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must be in"):
        lm.forward(ids(1, 4), routed_experts=torch.full((2, 1, 4, K), E, dtype=torch.long))
