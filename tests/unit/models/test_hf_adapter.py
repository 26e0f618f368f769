"""HF adapter: a tiny random Llama saved to tmp_path and loaded back — no hub, no downloads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the HF adapter tests need the 'transformers' package")

from transformers import LlamaConfig, LlamaForCausalLM

from rlbus.engines.base import GenerationRequest
from rlbus.engines.torch_engine import TorchEngine
from rlbus.errors import ConfigError
from rlbus.models.hf import HFCausalLM
from rlbus.models.tokenizer import ByteTokenizer

VOCAB = 272


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lm(model_dir: Path) -> HFCausalLM:
    return HFCausalLM.from_pretrained(model_dir)


def test_loads_the_saved_weights(model_dir: Path, lm: HFCausalLM) -> None:
    reference = LlamaForCausalLM.from_pretrained(model_dir)
    ref = reference.state_dict()
    live = lm.state_dict()
    assert live.keys() == ref.keys()
    assert all(torch.equal(live[k], ref[k]) for k in ref)
    assert lm.max_seq_len == 64 and lm.device == torch.device("cpu")


def test_left_padded_incremental_decoding_matches_full_forward(lm: HFCausalLM) -> None:
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    full = lm.forward(ids).logits[0]  # [7, V]
    # Row 0 is the same sequence left padded by 2; decode its last 3 tokens one at a time on the cache.
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], dim=1)  # [1, 9]
    valid = torch.tensor([[False, False] + [True] * 7])
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    cache = lm.new_cache(1, 9)
    out = lm.forward(padded[:, :6], positions=positions[:, :6], key_mask=valid[:, :6], cache=cache)
    steps = [out.logits[0, 2:]]
    for t in range(6, 9):
        out = lm.forward(
            padded[:, t : t + 1], positions=positions[:, t : t + 1], key_mask=valid[:, : t + 1], cache=out.cache
        )
        steps.append(out.logits[0])
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-4)
    assert out.routed_experts is None


def test_torch_engine_drives_the_hf_model(lm: HFCausalLM) -> None:
    tok = ByteTokenizer()
    engine = TorchEngine(lm, tokenizer=tok, seed=2)
    reqs = [
        GenerationRequest(prompt_ids=tuple(tok.encode("hi", bos=True)), max_new_tokens=5, temperature=0.8),
        GenerationRequest(prompt_ids=tuple(tok.encode("longer prompt", bos=True)), max_new_tokens=4),
    ]
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        seq = torch.tensor([req.prompt_ids + res.token_ids])
        P = len(req.prompt_ids)
        logits = lm.forward(seq).logits[0, P - 1 : -1] / req.temperature  # [N, V]
        expected = logits.log_softmax(-1).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(res.logprobs, expected, atol=2e-4, rtol=0)
        assert res.routed_experts is None


def test_state_dict_is_live(lm: HFCausalLM) -> None:
    ids = torch.tensor([[1, 2, 3]])
    before = lm.forward(ids).logits
    w = lm.state_dict()["lm_head.weight"]
    original = w.clone()
    try:
        w.mul_(2.0)
        torch.testing.assert_close(lm.forward(ids).logits, before * 2.0, atol=1e-5, rtol=1e-4)
    finally:
        w.copy_(original)


def test_missing_transformers_is_a_config_error(monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ConfigError, match="transformers"):
        HFCausalLM.from_pretrained(model_dir)
