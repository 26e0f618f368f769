"""GRPO steps on a Hugging Face model (a tiny random Llama with a tied embedding): the trainer's chunked
log-probs equal the HF model's own logits, a step trains, gradient checkpointing, micro-batches and the
projection's chunk size change nothing but memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbus.models.hf import HFCausalLM
from rlbus.rl.logprobs import sampled_token_logprobs
from rlbus.training.batch import Group, Sample, pack
from rlbus.training.step import GRPOConfig, grpo_step, score

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def new_model(seed: int = 0) -> HFCausalLM:
    return HFCausalLM.from_config(transformers.LlamaConfig(**LLAMA), seed=seed)


def make_sample(g: torch.Generator, prompt: int, completion: int, *, temperature: float = 1.0) -> Sample:
    T = prompt + completion
    mask = torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(completion, dtype=torch.bool)])
    return Sample(
        token_ids=torch.randint(0, 512, (T,), generator=g),
        loss_mask=mask,
        logprobs=torch.where(mask, -6.0 + torch.rand(T, generator=g), 0.0),
        versions=torch.where(mask, 0, -1),
        temperature=temperature,
    )


def make_groups(seed: int = 0) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    a = (make_sample(g, 3, 5), make_sample(g, 6, 2, temperature=0.7), make_sample(g, 2, 7))
    b = (make_sample(g, 4, 4), make_sample(g, 5, 6, temperature=1.3))
    return [Group(samples=a, rewards=torch.tensor([1.0, 0.0, 0.5])), Group(samples=b, rewards=torch.tensor([0.0, 2.0]))]


def step(model: HFCausalLM, config: GRPOConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradient) of one step at lr 0, so the weights stay put."""
    m = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), make_groups(), config=config, version=0)
    return m.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_trainer_logprobs_equal_the_hf_models_own_logits() -> None:
    model = new_model()
    samples = [s for g in make_groups() for s in g.samples]
    batch = pack(samples, torch.zeros(len(samples)))
    logp, experts = score(model, batch, replay=False, chunk=3)  # [B, S]
    assert experts is None
    with torch.no_grad():
        logits = model.hf(input_ids=batch.inputs, attention_mask=batch.key_mask.long()).logits  # [B, S, V]
    want = sampled_token_logprobs(logits / batch.temperature[:, None, None], batch.targets)  # [B, S]
    torch.testing.assert_close(logp[batch.loss_mask], want[batch.loss_mask], atol=1e-5, rtol=1e-5)
    assert bool((logp[~batch.loss_mask] == 0).all())


def test_step_trains_the_hf_model_and_reports() -> None:
    model = new_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = grpo_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), make_groups(), config=GRPOConfig(),
                  version=0)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight  # still one tensor
    assert m.optimizer_steps == 1 and m.rows == 5 and m.tokens == 5 + 2 + 7 + 4 + 6
    assert np.isfinite(m.loss) and m.grad_norm > 0 and m.kl_k3 > 0 and 0 < m.is_ess <= 1
    assert m.router_flip_rate is None and m.aux_loss == 0.0  # dense: no routing, no balancing loss


def test_gradient_checkpointing_changes_nothing_but_memory() -> None:
    config = GRPOConfig(max_grad_norm=0.0)
    loss, want = step(new_model(), config)
    model = new_model()
    model.set_gradient_checkpointing(True)
    got_loss, got = step(model, config)
    assert got_loss == pytest.approx(loss, abs=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("knobs", [{"micro_batch_rows": 2}, {"logprob_chunk": 3}])
def test_micro_batches_and_projection_chunks_give_the_same_gradient(knobs: dict[str, int]) -> None:
    loss, want = step(new_model(), GRPOConfig(max_grad_norm=0.0))
    got_loss, got = step(new_model(), GRPOConfig(max_grad_norm=0.0, **knobs))
    assert got_loss == pytest.approx(loss, abs=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)


def test_bf16_autocast_keeps_fp32_master_weights() -> None:
    model = new_model()
    m = grpo_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), make_groups(),
                  config=GRPOConfig(compute_dtype="bfloat16"), version=0)
    assert np.isfinite(m.loss) and m.grad_norm > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
