"""TorchEngine: processed log-probs against a full forward, stops, seeding, experts, in-flight swaps."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from rlbus.engines.base import Engine, GenerationRequest, GenerationResult, SwapPoint
from rlbus.engines.torch_engine import TorchEngine
from rlbus.models.base import LMOutput
from rlbus.models.policy import Policy, PolicyConfig
from rlbus.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
CFG = PolicyConfig.tiny()


def _prompts() -> list[tuple[int, ...]]:
    # Different lengths, so the batch is left padded.
    return [tuple(TOK.encode("hello", bos=True)), (TOK.bos_id, 65), tuple(TOK.encode("policy!", bos=True))]


# ---------------------------------------------------------------------------------------------------------
# log-probs are those of the distribution actually sampled from


def _reference_logprob(logits: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float) -> float:
    """log π'(token) written independently of the engine: scale, keep top-k, keep the nucleus, renormalise."""
    scaled = (logits.double() / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k > 0:
        order = order[:top_k]
    z = max(scaled[i] for i in order)
    weights = {i: pow(2.718281828459045, scaled[i] - z) for i in order}
    total = sum(weights.values())
    nucleus, mass = [], 0.0
    for i in order:  # smallest most-likely prefix whose mass reaches top_p
        nucleus.append(i)
        mass += weights[i] / total
        if mass >= top_p:
            break
    assert token in nucleus, "the engine sampled a token outside the truncated support"
    kept = sum(weights[i] for i in nucleus)
    return float(torch.tensor(weights[token] / kept).log())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 12, 1.0), (0.8, 0, 0.6), (0.9, 20, 0.7)]
)
def test_logprobs_match_a_full_forward_of_the_processed_distribution(
    policy: Policy, temperature: float, top_k: int, top_p: float
) -> None:
    engine = TorchEngine(policy, tokenizer=TOK, seed=3, pad_id=TOK.pad_id)
    reqs = [
        GenerationRequest(prompt_ids=p, max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p)
        for p in _prompts()
    ]
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.logprob_spec.temperature == temperature
        assert (res.logprob_spec.top_k, res.logprob_spec.top_p, res.logprob_spec.processed) == (top_k, top_p, True)
        seq = torch.tensor([req.prompt_ids + res.token_ids])
        logits = policy(seq).logits[0]  # [P + N, V], unpadded, no cache
        P = len(req.prompt_ids)
        expected = [
            _reference_logprob(logits[P - 1 + j], tok, temperature, top_k, top_p) for j, tok in enumerate(res.token_ids)
        ]
        torch.testing.assert_close(res.logprobs, torch.tensor(expected, dtype=torch.float32), atol=2e-4, rtol=0)


def test_greedy_is_argmax_with_zero_logprobs(policy: Policy) -> None:
    engine = TorchEngine(policy, tokenizer=TOK)
    req = GenerationRequest(prompt_ids=_prompts()[0], max_new_tokens=5, temperature=0.0)
    (res,) = engine.generate([req])
    assert torch.equal(res.logprobs, torch.zeros(5))
    seq = torch.tensor([req.prompt_ids + res.token_ids])
    argmax = policy(seq).logits[0, len(req.prompt_ids) - 1 : -1].argmax(-1)
    assert tuple(argmax.tolist()) == res.token_ids


# ---------------------------------------------------------------------------------------------------------
# stops, lengths, validation — on a scripted model whose greedy output is "the next byte"


class NextByte(torch.nn.Module):
    """A CausalLM whose logits favour (last id + 1): prompt "a" greedily continues "bcdef..."."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(CFG.vocab))
        self.calls = 0

    @property
    def max_seq_len(self) -> int:
        return 64

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_cache(self, batch: int, max_len: int) -> Any:
        return None

    def forward(
        self,
        idx: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: Any = None,
        logits_to_keep: int = 0,
    ) -> LMOutput:
        self.calls += 1
        nxt = (idx + 1) % CFG.vocab  # [B, T]
        logits = 20.0 * torch.nn.functional.one_hot(nxt, CFG.vocab).float() + self.bias  # [B, T, V]
        return LMOutput(logits=logits, cache=cache)


def _greedy(prompt: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(TOK.encode(prompt)), temperature=0.0, **kw)


def test_stop_string_ends_generation_and_is_cut_from_text() -> None:
    engine = TorchEngine(NextByte(), tokenizer=TOK)
    (res,) = engine.generate([_greedy("a", max_new_tokens=10, stop=("de",))])
    assert res.token_ids == tuple(TOK.encode("bcde"))  # the token completing the stop string is kept
    assert res.text == "bc"
    assert res.finish_reason == "stop"


def test_stop_token_ends_generation_and_is_not_in_text() -> None:
    engine = TorchEngine(NextByte(), tokenizer=TOK)
    (res,) = engine.generate([_greedy("a", max_new_tokens=10, stop_token_ids=(ord("d"),))])
    assert res.token_ids == tuple(TOK.encode("bcd"))
    assert (res.text, res.finish_reason) == ("bc", "stop")


def test_rows_finish_independently_in_one_batch() -> None:
    model = NextByte()
    engine = TorchEngine(model, tokenizer=TOK)
    results = engine.generate(
        [
            _greedy("a", max_new_tokens=3),
            _greedy("kl", max_new_tokens=8, stop=("p",)),
            _greedy("x", max_new_tokens=2),
        ]
    )
    assert [r.text for r in results] == ["bcd", "mno", "yz"]
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    assert model.calls == 4  # the longest row (m n o p) needed 4 forwards; the loop stopped then


def test_satisfies_the_engine_protocol() -> None:
    engine: Engine = TorchEngine(NextByte(), policy_version=4)  # mypy checks the structural match
    assert engine.policy_version == 4


def test_invalid_requests_are_rejected_up_front() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        TorchEngine(NextByte(), tokenizer=TOK).generate([_greedy("a" * 60, max_new_tokens=10)])
    with pytest.raises(ValueError, match="no tokenizer"):
        TorchEngine(NextByte()).generate([_greedy("a", max_new_tokens=2, stop=("x",))])
    with pytest.raises(ValueError):
        GenerationRequest(prompt_ids=(), max_new_tokens=1)
    with pytest.raises(ValueError):
        GenerationRequest(prompt_ids=(1,), max_new_tokens=1, top_p=0.0)
    assert TorchEngine(NextByte()).generate([]) == []


# ---------------------------------------------------------------------------------------------------------
# seeding


def _sampled(policy: Policy, seed: int, reqs: list[GenerationRequest]) -> list[GenerationResult]:
    return TorchEngine(policy, tokenizer=TOK, seed=seed).generate(reqs)


def test_same_seed_same_samples_different_seed_different_samples(policy: Policy) -> None:
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=8) for p in _prompts()]
    a, b, c = _sampled(policy, 7, reqs), _sampled(policy, 7, reqs), _sampled(policy, 8, reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_request_seed_is_independent_of_engine_state(policy: Policy) -> None:
    engine = TorchEngine(policy, tokenizer=TOK, seed=0)
    req = GenerationRequest(prompt_ids=_prompts()[0], max_new_tokens=8, seed=1234)
    first = engine.generate([req])[0]
    engine.generate([GenerationRequest(prompt_ids=_prompts()[1], max_new_tokens=8)])  # advances the engine rng
    assert engine.generate([req])[0].token_ids == first.token_ids


# ---------------------------------------------------------------------------------------------------------
# routed experts


def test_routed_experts_cover_every_input_token_and_match_a_full_forward(policy: Policy) -> None:
    engine = TorchEngine(policy, tokenizer=TOK, seed=5)
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=n) for p, n in zip(_prompts(), (4, 6, 2), strict=True)]
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.routed_experts is not None
        inputs = req.prompt_ids + res.token_ids[:-1]  # the last token is never fed
        assert res.routed_experts.shape == (CFG.n_layer, len(inputs), CFG.top_k)
        full = policy(torch.tensor([inputs])).routed_experts
        assert full is not None
        assert torch.equal(res.routed_experts.long(), full[:, 0])


# ---------------------------------------------------------------------------------------------------------
# weight swaps between steps


def test_hook_runs_between_decode_steps_only() -> None:
    calls: list[int] = []
    model = NextByte()
    engine = TorchEngine(model, tokenizer=TOK, between_steps=lambda: calls.append(model.calls))
    engine.generate([_greedy("a", max_new_tokens=5)])
    assert calls == [1, 2, 3, 4]  # after forwards 1..4, before forwards 2..5; not before prefill or after the end


def test_in_place_swap_mid_generation_changes_tokens_and_versions(policy: Policy) -> None:
    # Negating lm_head at the boundary after the 3rd token turns greedy argmax into argmin. lm_head does not
    # touch the KV cache, so the tokens after the swap are exactly the swapped model's greedy choices.
    req = GenerationRequest(prompt_ids=_prompts()[2], max_new_tokens=7, temperature=0.0)
    steps = 0
    original = policy.lm_head.weight.detach().clone()

    def hook() -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            engine.state_dict()["lm_head.weight"].mul_(-1.0)  # the live tensor, in place
            engine.policy_version = 1

    engine = TorchEngine(policy, tokenizer=TOK, between_steps=hook)
    try:
        (res,) = engine.generate([req])
        assert res.policy_versions == (0, 0, 0, 1, 1, 1, 1)
        seq = torch.tensor([req.prompt_ids + res.token_ids])
        P = len(req.prompt_ids)
        after = policy(seq).logits[0, P - 1 : -1].argmax(-1).tolist()  # swapped weights
        with torch.no_grad():
            policy.lm_head.weight.copy_(original)
        before = policy(seq).logits[0, P - 1 : -1].argmax(-1).tolist()
        assert list(res.token_ids[:3]) == before[:3]
        assert list(res.token_ids[3:]) == after[3:]
        assert res.token_ids[3:] != tuple(before[3:])
    finally:
        with torch.no_grad():
            policy.lm_head.weight.copy_(original)


def test_swap_from_another_thread_lands_at_a_step_boundary() -> None:
    model = NextByte()
    swap_point = SwapPoint()
    applied_at: list[int] = []
    steps = 0

    def swap() -> str:
        with torch.no_grad():
            engine.state_dict()["bias"][ord("z")] = 100.0  # from now on greedy emits "z"
        engine.policy_version = 5
        applied_at.append(model.calls)
        return "done"

    futures = []

    def hook() -> None:
        # At the 2nd boundary another thread submits; generation is in flight, so the swap must queue
        # and then run at this same boundary, right after the hook.
        nonlocal steps
        steps += 1
        if steps == 2:
            t = threading.Thread(target=lambda: futures.append(swap_point.submit(swap)))
            t.start()
            t.join()
            assert swap_point.pending == 1 and not applied_at

    engine = TorchEngine(model, tokenizer=TOK, between_steps=hook, swap_point=swap_point)
    (res,) = engine.generate([_greedy("a", max_new_tokens=5)])
    assert applied_at == [2]
    assert futures[0].result(timeout=1) == "done"
    assert res.text == "bczzz"
    assert res.policy_versions == (0, 0, 5, 5, 5)


def test_swap_point_runs_at_once_when_idle_and_reports_errors() -> None:
    sp = SwapPoint()
    assert sp.submit(lambda: 42).result(timeout=1) == 42

    def boom() -> None:
        raise RuntimeError("bad chunk")

    with pytest.raises(RuntimeError, match="bad chunk"):
        sp.submit(boom).result(timeout=1)


async def test_swap_point_apply_waits_for_the_running_generation() -> None:
    sp = SwapPoint()
    assert await sp.apply(lambda: "idle") == "idle"
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def generate() -> None:
        with sp.generating():
            started.set()
            release.wait(timeout=5)
            order.append("step")
            sp.at_boundary()

    t = threading.Thread(target=generate)
    t.start()
    started.wait(timeout=5)

    def swap() -> str:
        order.append("swap")
        return "swapped"

    task = asyncio.create_task(sp.apply(swap))
    for _ in range(5000):  # wait until it is queued (not run: a generation is in flight)
        if sp.pending:
            break
        await asyncio.sleep(0.001)
    assert sp.pending == 1
    assert not task.done()
    release.set()
    assert await task == "swapped"
    t.join()
    assert order == ["step", "swap"]


def test_load_weights_validates_then_applies() -> None:
    engine = TorchEngine(NextByte(), tokenizer=TOK)
    with pytest.raises(KeyError):
        engine.load_weights([("nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("bias", torch.zeros(3))], version=1)
    assert engine.policy_version == 0
    bias = torch.zeros(CFG.vocab)
    bias[ord("q")] = 100.0
    engine.load_weights([("bias", bias)], version=2)
    assert engine.policy_version == 2
    (res,) = engine.generate([_greedy("a", max_new_tokens=2)])
    assert res.text == "qq" and res.policy_versions == (2, 2)
