"""The engines' test models: rlbus's tiny MoE policy (in-house `KVCache`) and a random Llama (transformers'
`DynamicCache`), so every engine path is checked on both cache types."""

from __future__ import annotations

import pytest
import torch

from rlbus.models.base import CausalLM
from rlbus.models.policy import Policy, PolicyConfig


@pytest.fixture(scope="module")
def policy() -> Policy:
    """`PolicyConfig.tiny()`: MoE, 4 experts, top-2 (routed experts are recorded)."""
    torch.manual_seed(0)
    return Policy(PolicyConfig.tiny()).eval()


@pytest.fixture(scope="module")
def llama() -> CausalLM:
    """A random 2-layer Llama (vocabulary 512, GQA 4/2 heads) behind `HFCausalLM`."""
    transformers = pytest.importorskip("transformers")
    from rlbus.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    return HFCausalLM.from_config(config, seed=0)
