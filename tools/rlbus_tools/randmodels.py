"""Random-weight models of real configurations, built where they run, with nothing to download.

The GPU check and the benches need SmolLM2-, Qwen2.5-1.5B- and Qwen2.5-7B-sized models on a machine that
cannot reach a model hub. Their ``transformers`` configurations are written out here (from the models'
published ``config.json``); the weights are random (initialised on the target device, so a 7 B model takes
seconds, not minutes on a CPU). `save_dir` writes one as a model directory — safetensors, config and a
byte-level BPE tokenizer with ChatML special tokens (``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>``
2, as SmolLM2's) whose vocabulary is padded to the model's — which is what ``[model] path`` and ``rlbus demo
--model DIR`` read. ``layers`` keeps the first n blocks of a configuration (a 7 B shape sized to fit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: name → (transformers config class, its fields).
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": ("LlamaConfig", {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }),
    "qwen2.5-1.5b": ("Qwen2Config", {
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
    }),
    "qwen2.5-7b": ("Qwen2Config", {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False,
    }),
    # a CPU-sized stand-in of the same family (the GPU check's dry run)
    "toy": ("LlamaConfig", {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }),
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def config(name: str, *, layers: int | None = None) -> Any:
    """The ``transformers`` config of ``name`` (`CONFIGS`), its first ``layers`` blocks when given."""
    import transformers

    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(CONFIGS)}")
    cls, fields = CONFIGS[name]
    fields = {**fields, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return getattr(transformers, cls)(**fields)


def params(name: str, *, layers: int | None = None) -> int:
    """Parameters of the model, computed from the config without building it."""
    c = config(name, layers=layers)
    d, f, v, L = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (d // c.num_attention_heads)
    bias = (d + 2 * kv) if c.model_type == "qwen2" else 0
    layer = d * d * 2 + 2 * d * kv + bias + 3 * d * f + 2 * d
    return L * layer + v * d * (1 if c.tie_word_embeddings else 2) + d


def build(name: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int | None = None,
          seed: int = 0) -> Any:
    """A random `rlbus.models.hf.HFCausalLM` of ``name``, initialised on ``device`` in ``dtype``."""
    from rlbus.models.hf import HFCausalLM

    with torch.device(device):
        return HFCausalLM.from_config(config(name, layers=layers), seed=seed, dtype=dtype)


def tokenizer(vocab: int) -> Any:
    """A byte-level BPE tokenizer with the ChatML special tokens and template, its vocabulary padded with
    ``<extra_i>`` tokens to ``vocab`` ids (so every id a random model samples decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        table[ch] = len(table)
    for i in range(len(table), vocab):
        table[f"<extra_{i}>"] = i
    backend = Tokenizer(models.BPE(vocab=table, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHATML)


def save_dir(name: str, root: Path, *, device: str = "cpu", layers: int | None = None,
             dtype: torch.dtype = torch.bfloat16) -> Path:
    """``root/<name>[-<layers>L]``: a model directory of a random ``name`` (weights saved in ``dtype``)."""
    directory = root / (name if layers is None else f"{name}-{layers}L")
    if (directory / "config.json").is_file():
        return directory
    model = build(name, device=device, dtype=dtype, layers=layers)
    model.hf.save_pretrained(str(directory))
    tokenizer(model.vocab_size).save_pretrained(str(directory))
    del model
    return directory
