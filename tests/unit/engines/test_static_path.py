"""The static path (`rlbus.engines.static`): greedy equals ``transformers.generate``; it computes what the
dynamic path computes (tokens, processed log-probs, prefix reuse, live weights) through arena moves; the
capturable step form equals the eager one; on CUDA, captured graphs replay it exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbus.engines.base import GenerationRequest, GenerationResult
from rlbus.engines.static import static_support
from rlbus.engines.torch_engine import TorchEngine
from rlbus.models.hf import HFCausalLM

transformers = pytest.importorskip("transformers")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")


def smollm2_config(layers: int = 2) -> Any:
    """SmolLM2-135M's architecture (its sizes, GQA 9/3, tied embeddings, RoPE θ 1e5), ``layers`` of its 30."""
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def smollm2() -> HFCausalLM:
    return HFCausalLM.from_config(smollm2_config(), seed=0)


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]


def hf_greedy(model: HFCausalLM, prompts: list[tuple[int, ...]], new: int) -> list[tuple[int, ...]]:
    """``transformers.generate`` greedy on the prompts as one left-padded batch."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), 2, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    out = model.hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                            pad_token_id=2, eos_token_id=None)  # fmt: skip
    return [tuple(row) for row in out[:, P:].tolist()]


@pytest.mark.parametrize("lengths", [(7,), (5, 9, 3, 12)])
def test_greedy_equals_transformers_generate_on_smollm2s_architecture(
    smollm2: HFCausalLM, lengths: tuple[int, ...]
) -> None:
    assert static_support(smollm2) is None
    prompts = _prompts(49152, lengths)
    engine = TorchEngine(smollm2, max_batch=4)
    results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=12, temperature=0.0) for p in prompts])
    assert engine.static and [r.token_ids for r in results] == hf_greedy(smollm2, prompts, 12)


def _mixed(vocab: int, n: int = 9, **kw: Any) -> list[GenerationRequest]:
    """Short and long prompts arriving in one queue: newcomers longer than the running rows move them right,
    long generations make the arena compact or grow."""
    lengths = [3 + (17 * i) % 40 for i in range(n)]
    news = [(2, 24, 5, 40, 1, 9)[i % 6] for i in range(n)]
    return [GenerationRequest(prompt_ids=p, max_new_tokens=m, seed=10 + i, request_id=str(i), **kw)
            for i, (p, m) in enumerate(zip(_prompts(vocab, tuple(lengths), seed=5), news, strict=True))]  # fmt: skip


def _same(a: list[GenerationResult], b: list[GenerationResult], atol: float = 1e-4) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.request_id, x.token_ids, x.finish_reason) == (y.request_id, y.token_ids, y.finish_reason)
        assert torch.allclose(x.logprobs, y.logprobs, atol=atol), (x.logprobs, y.logprobs)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 40, "top_p": 0.9}])
def test_the_static_path_computes_what_the_dynamic_path_computes(llama: Any, sampling: dict[str, Any]) -> None:
    reqs = _mixed(512, **sampling)
    dynamic = TorchEngine(llama, static=False, max_batch=3).generate(reqs)
    engine = TorchEngine(llama, max_batch=3)
    static = engine.generate(reqs)
    _same(dynamic, static)
    arena = engine._arena
    assert arena is not None and arena.shifts > 0 and arena.generation > 0  # rows moved, the arena grew
    assert engine.merges > 0


def test_the_capturable_step_form_equals_the_eager_one(llama: Any) -> None:
    """Buckets with idle slots, the write column from a device tensor, every column attended: on a CPU the
    graph form runs uncaptured and must give the eager step's tokens and log-probs."""
    reqs = _mixed(512, temperature=0.9, top_p=0.95)
    eager = TorchEngine(llama, max_batch=5, cuda_graphs=False).generate(reqs)
    engine = TorchEngine(llama, max_batch=5, cuda_graphs=True)
    assert engine.graphs is not None and engine.graphs.buckets == [1, 2, 4, 5]
    _same(eager, engine.generate(reqs))


def test_prefix_reuse_and_top_logprobs_on_the_static_path(llama: Any) -> None:
    engine = TorchEngine(llama, max_batch=4, prefix_cache_tokens=10_000)
    first = engine.generate([GenerationRequest(prompt_ids=_prompts(512, (50,))[0], max_new_tokens=5, seed=1)])[0]
    follow = GenerationRequest(prompt_ids=(*first.prompt_ids, *first.token_ids, 7, 8), max_new_tokens=4, seed=2,
                               top_logprobs=3)  # fmt: skip
    cached = engine.generate([follow])[0]
    assert cached.extra["cached_prompt_tokens"] == 50 + 5 - 1
    plain = TorchEngine(llama, static=False).generate([follow])[0]
    _same([plain], [cached])
    top = cached.extra["top_logprobs"]
    assert len(top) == 4 and all(len(step) == 3 for step in top)
    for step, lp in zip(top, cached.logprobs.tolist(), strict=True):
        assert step[0][1] >= lp - 1e-6 and [p for _, p in step] == sorted((p for _, p in step), reverse=True)


def test_a_swap_that_repoints_the_weights_changes_the_next_tokens(llama: Any) -> None:
    """Weight sync's double buffer re-points each parameter at a spare copy between steps; the static path
    reads the modules live, so the tokens after the swap are the new weights' (and carry the new version)."""
    req = GenerationRequest(prompt_ids=_prompts(512, (6,))[0], max_new_tokens=8, temperature=0.0)
    before = TorchEngine(llama).generate([req])[0]
    params = dict(llama.named_parameters())
    originals = {name: p.data for name, p in params.items()}
    swapped = {name: t.clone().mul_(-1.0) if name.endswith("lm_head.weight") or "embed" in name else t.clone()
               for name, t in originals.items()}  # fmt: skip
    steps = 0

    def swap_after_three() -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            for name, p in params.items():
                p.data = swapped[name]
            engine.policy_version = 1

    engine = TorchEngine(llama, between_steps=swap_after_three)
    try:
        res = engine.generate([req])[0]
    finally:
        for name, p in params.items():
            p.data = originals[name]
    assert res.policy_versions == (0, 0, 0, 1, 1, 1, 1, 1)
    assert res.token_ids[:3] == before.token_ids[:3] and res.token_ids[3:] != before.token_ids[3:]


def test_models_off_the_static_path_say_why(policy: Any) -> None:
    assert "not a transformers model" in (static_support(policy) or "")
    with pytest.raises(ValueError, match="static=True"):
        TorchEngine(policy, static=True)
    assert not TorchEngine(policy).static


@cuda
@pytest.mark.cuda
def test_captured_graphs_replay_the_capturable_step_exactly(llama: Any) -> None:
    """The captured step against the same step run uncaptured (same kernels, same inputs): identical tokens
    and log-probs; then new graphs for re-pointed weights, and the same results again."""
    from rlbus.engines.graphs import StepGraphs

    model = HFCausalLM.from_config(llama.hf.config, seed=0, dtype=torch.bfloat16).to("cuda")
    reqs = _mixed(512, temperature=1.0)
    reference = TorchEngine(model, max_batch=8)
    reference.graphs = StepGraphs(8, capture=False)  # the capturable form, run eagerly
    uncaptured = reference.generate(reqs)
    engine = TorchEngine(model, max_batch=8)
    graphed = engine.generate(reqs)
    assert engine.graphs is not None and engine.graphs.enabled and engine.graphs.replays > engine.graphs.captures > 0
    _same(uncaptured, graphed, atol=0.0)
    for p in model.parameters():  # what weight sync's double buffer does: new addresses, same values
        p.data = p.data.clone()
    captures = engine.graphs.captures
    _same(uncaptured, engine.generate(reqs), atol=0.0)
    assert engine.graphs.captures > captures


@cuda
@pytest.mark.cuda
def test_the_eager_and_graphed_steps_agree_on_cuda(llama: Any) -> None:
    """The eager step (columns in use) and the graphed one (every column, masked) in fp32: the same greedy
    tokens, log-probs equal to float rounding."""
    model = HFCausalLM.from_config(llama.hf.config, seed=0).to("cuda")
    reqs = _mixed(512, temperature=0.0)
    eager = TorchEngine(model, max_batch=8, cuda_graphs=False).generate(reqs)
    _same(eager, TorchEngine(model, max_batch=8).generate(reqs))


@cuda
@pytest.mark.cuda
def test_greedy_equals_transformers_generate_on_cuda() -> None:
    """fp32 (bf16 rounding flips near ties of a random model: `rlbus bench decode` reports that agreement)."""
    model = HFCausalLM.from_config(smollm2_config(layers=4), seed=0).to("cuda")
    prompts = _prompts(49152, (5, 9, 3, 12, 7, 7, 20, 1))
    engine = TorchEngine(model, max_batch=8)
    results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=16, temperature=0.0) for p in prompts])
    assert [r.token_ids for r in results] == [hf_greedy(model, [p], 16)[0] for p in prompts]


def test_constrained_rows_decode_on_the_static_path_as_on_the_dynamic_one() -> None:
    """The per-row logits mask (`TorchEngine._allowed`) on the static path: a grammar-constrained row beside a
    free one samples what the dynamic path samples, each token inside its grammar's mask."""
    from rlbus.engines.constraints import Grammars, json_constraint, unpack
    from rlbus.envs.chat import ChatFormat
    from rlbus.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    chat = ChatFormat.for_byte_tokenizer(tok)
    llama = HFCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512), seed=0)  # the byte tokenizer's vocabulary
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reqs = [GenerationRequest(prompt_ids=tuple(tok.encode(p, bos=True)), max_new_tokens=12, seed=i,
                              stop_token_ids=chat.stop_ids, constraint=json_constraint(schema) if i == 0 else None)
            for i, p in enumerate(["json:", "free text:"])]  # fmt: skip
    engines = [TorchEngine(llama, tokenizer=chat, max_batch=2, grammars=Grammars(chat), static=static)
               for static in (True, False)]  # fmt: skip
    static, dynamic = (engine.generate(reqs) for engine in engines)
    _same(dynamic, static)
    constrained = static[0]
    assert constrained.allowed is not None and constrained.allowed.shape[0] == len(constrained.token_ids)
    allowed = unpack(constrained.allowed, 272)  # [N, V]
    assert all(bool(allowed[j, t]) for j, t in enumerate(constrained.token_ids))
    assert constrained.text.startswith("{") and static[1].allowed is None
