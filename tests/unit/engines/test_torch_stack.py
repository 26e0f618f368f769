"""The torch inference chain (`rlbus.engines.torch_stack`): the copy is in the inference dtype and leaves the
model it came from alone, the engines get the settings given, and the chain samples what a hand-built
copy → engine → batching chain samples."""

from __future__ import annotations

import copy

import torch

from rlbus.engines.base import GenerationRequest
from rlbus.engines.batching import BatchingEngine
from rlbus.engines.torch_engine import TorchEngine
from rlbus.engines.torch_stack import inference_copy, torch_stack
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.policy_source import PolicySource


def test_a_model_in_memory_is_copied_cast_and_left_alone(policy: Policy) -> None:
    master = copy.deepcopy(policy).train()
    served = torch_stack(master, seed=3, max_batch=8, batch_calls=16, batch_window_s=0.02)
    assert served.weights is not master and not served.weights.training and master.training
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert {p.dtype for p in served.weights.parameters()} == {torch.bfloat16}
    copied = served.weights.state_dict()
    assert all(torch.equal(copied[k], v.to(torch.bfloat16)) for k, v in master.state_dict().items())
    engine, batching = served.engine, served.batching
    assert engine.model is served.weights and engine.tokenizer is None and engine.pad_id == 0
    assert engine.max_batch == 8 and engine.prefix_cache is None
    assert batching.engine is engine and (batching.max_batch, batching.window_s) == (16, 0.02)


def test_a_source_is_built_with_its_chat_format_and_pad_id() -> None:
    source = PolicySource(PolicyConfig.tiny())
    master = source.build(seed=5)
    served = torch_stack(source, initial=master.state_dict(), max_batch=4, prefix_cache_tokens=256)
    assert served.engine.tokenizer is source.chat and served.engine.pad_id == source.pad_id
    assert served.engine.prefix_cache is not None and served.engine.prefix_cache.max_tokens == 256
    assert served.batching.max_batch == 4 and served.batching.window_s == 0.005  # the batching engine's default
    copied = served.weights.state_dict()
    assert all(torch.equal(copied[k], v.to(torch.bfloat16)) for k, v in master.state_dict().items())
    fp32 = inference_copy(source, dtype=torch.float32, initial=master.state_dict())
    assert all(torch.equal(fp32.state_dict()[k], v) for k, v in master.state_dict().items())


def test_the_chain_samples_what_a_hand_built_chain_samples(policy: Policy) -> None:
    hand = BatchingEngine(TorchEngine(copy.deepcopy(policy).to(torch.bfloat16).eval(), seed=7, max_batch=4),
                          max_batch=4)  # fmt: skip
    built = torch_stack(policy, seed=7, max_batch=4).batching
    requests = [GenerationRequest(prompt_ids=(1, 2, 3 + i), max_new_tokens=6, temperature=1.0) for i in range(3)]
    for a, b in zip(hand.generate(requests), built.generate(requests), strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
