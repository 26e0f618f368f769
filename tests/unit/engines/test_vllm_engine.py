"""VLLMEngine. The import/error tests run everywhere; the generation test needs vLLM (and so a GPU).

`test_vllm_generates_processed_logprobs_and_loads_weights` is skipped only when ``import vllm`` fails —
which is always the case in this repository's CPU CI — so it has not been run here. It saves a tiny random
Llama with the byte vocabulary to tmp_path (no downloads) and checks the contract end to end on a GPU box.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from rlbus.engines.base import Engine, GenerationRequest
from rlbus.engines.vllm_engine import VLLMEngine
from rlbus.errors import ConfigError


def _conforms(engine: VLLMEngine) -> Engine:
    """Never called: mypy checks here that VLLMEngine satisfies the Engine protocol."""
    return engine


def test_importing_the_module_does_not_import_vllm() -> None:
    # Static check (a subprocess import would cost seconds of torch start-up): no module-level statement
    # imports vllm; every vllm import sits inside a function body, run only when an engine is used.
    import rlbus.engines.vllm_engine as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] == "vllm"]
    nested = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm")]
    assert nested, "the engine should import vllm lazily inside its methods"


def test_missing_vllm_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ConfigError, match="vllm"):
        VLLMEngine("/nonexistent")


def test_vllm_generates_processed_logprobs_and_loads_weights(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (CPU-only environment)")
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(tmp_path)
    engine = VLLMEngine(
        tmp_path,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.3,
        max_model_len=128,
        llm_kwargs={"skip_tokenizer_init": True, "enforce_eager": True},
    )
    req = GenerationRequest(prompt_ids=(257, 104, 105), max_new_tokens=6, temperature=0.7, top_k=50)
    (res,) = engine.generate([req])
    assert len(res.token_ids) == 6 and res.finish_reason == "length"
    assert res.policy_versions == (0,) * 6

    # processed log-probs: recompute log softmax(top-50(logits / 0.7)) with the same weights on CPU
    seq = torch.tensor([req.prompt_ids + res.token_ids])
    logits = hf(seq).logits[0, len(req.prompt_ids) - 1 : -1].float() / 0.7  # [N, V]
    kth = logits.topk(50, dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    expected = logits.log_softmax(-1).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs, expected.detach(), atol=2e-2, rtol=0)

    # weight update: negate lm_head (greedy turns into argmin); vLLM must now follow the updated CPU model
    with torch.no_grad():
        hf.lm_head.weight.neg_()
    engine.load_weights([("lm_head.weight", hf.lm_head.weight.detach())], version=3)
    prompt = (257, 104)
    (after,) = engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=3, temperature=0.0)])
    assert after.policy_versions == (3, 3, 3) and engine.policy_version == 3
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert after.token_ids == tuple(ids[len(prompt) :])
