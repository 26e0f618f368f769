"""Constrained decoding in the torch engine: every sampled token inside the grammar's mask, log-probs of the
masked and renormalised distribution, the masks returned, and rows without a constraint untouched."""

from __future__ import annotations

import json

import pytest
import torch

from rlbus.engines.base import GenerationRequest
from rlbus.engines.constraints import Grammars, apply_masks, json_constraint, tool_call_constraint, unpack, words
from rlbus.engines.torch_engine import TorchEngine
from rlbus.envs.chat import ChatFormat
from rlbus.models.policy import Policy
from rlbus.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
CHAT = ChatFormat.for_byte_tokenizer(TOK)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(CHAT)


def engine(policy: Policy, grammars: Grammars | None) -> TorchEngine:
    return TorchEngine(policy, tokenizer=CHAT, seed=5, pad_id=TOK.pad_id, grammars=grammars)


def request(max_new_tokens: int = 40, **kw: object) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(TOK.encode("json:", bos=True)), max_new_tokens=max_new_tokens,
                             stop_token_ids=CHAT.stop_ids, **kw)  # type: ignore[arg-type]


def test_unpack_and_apply_masks_by_hand() -> None:
    bits = torch.tensor([[0b101, 0], [0, -(1 << 31)]], dtype=torch.int32)  # row 0: ids 0, 2; row 1: id 63
    allowed = unpack(bits, 66)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2] and allowed[1].nonzero().flatten().tolist() == [63]
    assert words(64) == 2 and words(65) == 3
    logits = torch.zeros(3, 66)
    out = apply_masks(logits, torch.tensor([2, 0]), bits)
    assert torch.equal(out[1], logits[1])  # a row without a mask is untouched
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [63]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_schema_constrained_row_samples_valid_json_from_the_masked_distribution(
    policy: Policy, grammars: Grammars, temperature: float
) -> None:
    req = request(temperature=temperature, constraint=json_constraint(SCHEMA))
    (res,) = engine(policy, grammars).generate([req])
    assert res.finish_reason == "stop" and res.token_ids[-1] in CHAT.stop_ids
    value = json.loads(res.text)  # a random tiny model writes schema-valid JSON only because of the mask
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    assert res.logprob_spec.constrained and res.allowed is not None
    assert tuple(res.allowed.shape) == (len(res.token_ids), words(grammars.n_vocab))
    seq = torch.tensor([req.prompt_ids + res.token_ids])
    P = len(req.prompt_ids)
    logits = policy(seq).logits[0, P - 1 : -1]  # [N, V] one full forward, no cache
    allowed = unpack(res.allowed, logits.shape[-1])  # [N, V]
    tokens = torch.tensor(res.token_ids)
    assert allowed[torch.arange(len(tokens)), tokens].all()
    expected = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")) / temperature, -1)
    expected = expected.gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs, expected, atol=2e-4, rtol=0)
    free = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None]).squeeze(1)
    assert (res.logprobs - free).max() > 0.5  # the mask moved real mass: these are not the free log-probs
    assert torch.equal(grammars.replay(req.constraint, res.token_ids), res.allowed)  # type: ignore[arg-type]


def test_rows_without_a_constraint_are_sampled_as_without_grammars(policy: Policy, grammars: Grammars) -> None:
    free = request(max_new_tokens=12, seed=11)
    (alone,) = engine(policy, None).generate([free])
    mixed = engine(policy, grammars).generate([request(seed=3, constraint=json_constraint(SCHEMA)), free])
    assert mixed[1].token_ids == alone.token_ids  # its own seed's stream, its own unmasked distribution
    torch.testing.assert_close(mixed[1].logprobs, alone.logprobs, atol=1e-5, rtol=0)  # batch-shape rounding only
    assert mixed[1].allowed is None and not mixed[1].logprob_spec.constrained
    assert isinstance(json.loads(mixed[0].text), dict)


def test_a_required_tool_call_is_one_hermes_block(policy: Policy, grammars: Grammars) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}]
    req = request(max_new_tokens=80, constraint=tool_call_constraint(tools, name="add", parallel=False))
    (res,) = engine(policy, grammars).generate([req])
    assert res.finish_reason == "stop"
    head, body = res.text.split("\n", 1)
    assert head == "<tool_call>" and body.endswith("\n</tool_call>")
    call = json.loads(body.removesuffix("\n</tool_call>"))
    assert call["name"] == "add" and set(call["arguments"]) == {"a"}


def test_a_constraint_needs_grammars_and_a_bad_schema_is_refused(policy: Policy, grammars: Grammars) -> None:
    with pytest.raises(ValueError, match="no grammars"):
        engine(policy, None).submit([request(constraint=json_constraint())])
    with pytest.raises(ValueError, match="objectx"):
        grammars.check(json_constraint({"type": "objectx"}))
    with pytest.raises(ValueError, match="no tool named"):
        tool_call_constraint([{"type": "function", "function": {"name": "a"}}], name="b")
