"""The importance ratio under constrained decoding: the engine samples from the grammar-masked distribution
and records its masks; the trainer's re-forward masks the same logits, so on-policy π_trainer / π_behaviour
is 1 at every constrained token (to float rounding between a cached decode and a full forward), where
without the masks it would be off by the mass the grammar removed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlbus.engines.base import GenerationRequest
from rlbus.engines.constraints import Grammars, json_constraint
from rlbus.engines.torch_engine import TorchEngine
from rlbus.envs.chat import ChatFormat
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import ByteTokenizer
from rlbus.schemas import AllowedTokens, Rollout, SamplingInfo, TensorData
from rlbus.training.batch import check_rollout, pack, sample_from_generation, sample_from_rollout
from rlbus.training.step import score

TOK = ByteTokenizer()
CHAT = ChatFormat.for_byte_tokenizer(TOK)
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["word", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def policy() -> Policy:
    torch.manual_seed(1)
    return Policy(PolicyConfig.tiny()).eval()


def as_rollout(result, temperature: float) -> Rollout:  # type: ignore[no-untyped-def]
    """What the gateway records: prompt masked, the sampled ids trained, their masks as `AllowedTokens`."""
    P, N = len(result.prompt_ids), len(result.token_ids)
    ids = np.asarray(result.prompt_ids + result.token_ids, dtype=np.int32)
    return Rollout(
        rollout_id="r", prompt_id="p", group_index=0, group_size=1,
        token_ids=TensorData.from_numpy(ids),
        loss_mask=TensorData.from_numpy(np.r_[np.zeros(P), np.ones(N)].astype(np.uint8)),
        logprobs=TensorData.from_numpy(np.r_[np.zeros(P), result.logprobs.numpy()].astype(np.float32)),
        token_versions=TensorData.from_numpy(np.r_[-np.ones(P), np.zeros(N)].astype(np.int32)),
        sampling=SamplingInfo(temperature=temperature),
        allowed=AllowedTokens.pack(np.arange(P, P + N), result.allowed.numpy()),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_ratio_is_one_on_policy_at_constrained_tokens(policy: Policy, temperature: float) -> None:
    engine = TorchEngine(policy, tokenizer=CHAT, seed=2, pad_id=TOK.pad_id, grammars=Grammars(CHAT))
    requests = [GenerationRequest(prompt_ids=tuple(TOK.encode(p, bos=True)), max_new_tokens=48,
                                  temperature=temperature, stop_token_ids=CHAT.stop_ids, seed=i,
                                  constraint=json_constraint(SCHEMA)) for i, p in enumerate(["a:", "json please:"])]
    results = engine.generate(requests)
    # a random model may write the unbounded integer until max_new_tokens: a cut row is a JSON prefix
    assert any(r.finish_reason == "stop" for r in results)
    assert all(set(json.loads(r.text)) == {"word", "n"} for r in results if r.finish_reason == "stop")
    rollouts = [as_rollout(r, temperature) for r in results]
    for rollout in rollouts:
        check_rollout(rollout)
    from_bus = [sample_from_rollout(r) for r in rollouts]
    direct = [sample_from_generation(r) for r in results]
    for a, b in zip(from_bus, direct, strict=True):
        assert a.allowed_bits is not None and b.allowed_bits is not None
        assert torch.equal(a.allowed_bits, b.allowed_bits) and torch.equal(a.allowed_positions, b.allowed_positions)

    batch = pack(from_bus, torch.zeros(2))
    trainer, _ = score(policy, batch, replay=True)  # [B, S] the trainer's log-probs, masked as the engine's
    m = batch.loss_mask
    log_ratio = (trainer - batch.behaviour_logprobs)[m]
    assert log_ratio.abs().max() < 1e-4  # ratio exp(Δ) = 1 to float rounding: the same distribution

    free = pack([sample_from_generation(r) for r in results], torch.zeros(2))
    unmasked = free.__class__(**{**free.__dict__, "allowed_index": None, "allowed_bits": None})
    without, _ = score(policy, unmasked, replay=True)
    gap = (without - batch.behaviour_logprobs)[m]
    assert gap.min() < -0.5  # without the masks the trainer scores a different policy: ratios far from 1


def test_masks_at_positions_that_were_not_sampled_are_refused(policy: Policy) -> None:
    engine = TorchEngine(policy, tokenizer=CHAT, seed=0, pad_id=TOK.pad_id, grammars=Grammars(CHAT))
    (result,) = engine.generate([GenerationRequest(prompt_ids=tuple(TOK.encode("x", bos=True)), max_new_tokens=40,
                                                   stop_token_ids=CHAT.stop_ids, constraint=json_constraint(SCHEMA))])
    rollout = as_rollout(result, 1.0)
    assert result.allowed is not None
    bad = Rollout(**{**{f: getattr(rollout, f) for f in rollout.__struct_fields__},
                     "allowed": AllowedTokens.pack(np.arange(len(result.token_ids)), result.allowed.numpy())})
    with pytest.raises(ValueError, match="not sampled"):
        check_rollout(bad)
