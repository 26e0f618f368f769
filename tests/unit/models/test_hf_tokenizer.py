"""HFTokenizer: contents never produce special tokens, template text does; rendering is the template's."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers", reason="the HF tokenizer adapter tests need the 'transformers' package")

from rlbus.errors import ConfigError
from rlbus.models.hf_tokenizer import HFTokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_bpe(chat_template: str | None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>", chat_template=chat_template
    )


def test_encode_keeps_special_strings_as_text_and_encode_template_does_not() -> None:
    tok = HFTokenizer(byte_bpe(CHATML))
    end = tok.eos_id
    assert end in tok.special_ids and tok.bos_text == "<|im_start|>"
    assert end not in tok.encode("a<|im_end|>") and tok.decode(tok.encode("a<|im_end|>")) == "a<|im_end|>"
    assert tok.encode_template("a<|im_end|>") == [*tok.encode("a"), end]
    assert tok.decode([*tok.encode("hé"), end]) == "hé<|im_end|>"


def test_render_and_template_ids_are_the_templates() -> None:
    tok = HFTokenizer(byte_bpe(CHATML))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render(messages, add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.template_ids(messages) == tok.encode_template(tok.render(messages))


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    with pytest.raises(ConfigError, match="chat template"):
        HFTokenizer(byte_bpe(None))
