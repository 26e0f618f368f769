"""Byte tokenizer: exact round trips, special tokens only by id, the documented id layout."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlbus.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer

tok = ByteTokenizer()


def test_layout_matches_the_docstring_table() -> None:
    assert (PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE) == (256, 257, 258, 272)
    assert tok.token_id("<|user|>") == 260
    assert tok.token_id("<|tool_result|>") == 263
    assert tok.is_special(258) and not tok.is_special(255)
    with pytest.raises(KeyError):
        tok.token_id("<|nope|>")


@given(st.text())
def test_round_trip_is_exact(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_encode_is_utf8_bytes_with_optional_bos_eos() -> None:
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.encode("a", bos=True, eos=True) == [257, 97, 258]


def test_text_never_becomes_a_special_token() -> None:
    ids = tok.encode("<|eos|>")
    assert EOS_ID not in ids and all(i < 256 for i in ids)


def test_decode_renders_or_skips_specials() -> None:
    ids = [BOS_ID, 104, 105, tok.token_id("<|tool_call|>"), 33, EOS_ID]
    assert tok.decode(ids) == "<|bos|>hi<|tool_call|>!<|eos|>"
    assert tok.decode(ids, skip_special=True) == "hi!"


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert tok.decode([0xC3]) == "\ufffd"  # a lone lead byte: the model stopped mid-character


def test_out_of_vocabulary_id_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([VOCAB_SIZE])
    with pytest.raises(ValueError):
        tok.decode([-1])
