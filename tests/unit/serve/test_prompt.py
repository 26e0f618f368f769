"""Rendering a request: the template's own ids, and earlier turns as the ids actually sampled even where
decoding and re-encoding their text would give other ids (the offline tokenizer merges "he" and "ll")."""

from __future__ import annotations

from typing import Any

import pytest

from rlbus.envs.chat import ChatFormat
from rlbus.serve.api import turn_key
from rlbus.serve.prompt import SampledTurn, render
from tests.fixtures.hf import CHATML, offline_tokenizer


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.for_hf_tokenizer(offline_tokenizer(CHATML))


def sampled(chat: ChatFormat, context: list[int], text: str, position: int = 1) -> SampledTurn:
    """A turn whose ids spell ``text`` one byte-level character at a time (never merged) plus end-of-turn,
    sampled as message ``position``."""
    ids = [i for ch in text for i in chat.encode(ch)] + [chat.turn_end]
    assert ids[:-1] != chat.encode(text)  # re-tokenising the text would merge "he" / "ll"
    return SampledTurn(key=turn_key(text, None), prompt_ids=tuple(context), token_ids=tuple(ids),
                       logprobs=tuple(-0.5 for _ in ids), versions=tuple(3 for _ in ids), text=text,
                       finish_reason="stop", position=position)


def test_without_history_it_is_the_template_rendering(chat: ChatFormat) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = render(chat, messages)
    expected, _ = chat.render_messages(messages)
    assert out.ids == expected and not any(out.mask) and out.edits == []


def test_recorded_turns_keep_their_sampled_ids(chat: ChatFormat) -> None:
    first: list[dict[str, Any]] = [{"role": "user", "content": "say hello"}]
    context = render(chat, first).ids + list(chat.model_header)
    turn = sampled(chat, context, "hello hello")
    messages = [*first, {"role": "assistant", "content": "hello hello"}, {"role": "user", "content": "again"}]
    out = render(chat, messages, recorded={1: [turn]})
    assert out.edits == [] and out.mapped == [turn]
    start = len(context)
    assert out.ids[:start] == context
    assert out.ids[start : start + len(turn.token_ids)] == list(turn.token_ids)
    assert out.mask == [0] * start + [1] * len(turn.token_ids) + [0] * (len(out.ids) - start - len(turn.token_ids))
    assert out.versions[start : start + len(turn.token_ids)] == [3] * len(turn.token_ids)
    # the same history outside a session is rendered from text, as the template would
    plain = render(chat, messages)
    assert plain.ids == chat.render_messages(messages)[0] and plain.ids != out.ids


def test_edits_are_reported_and_masked(chat: ChatFormat) -> None:
    first: list[dict[str, Any]] = [{"role": "user", "content": "say hello"}]
    turn = sampled(chat, render(chat, first).ids + list(chat.model_header), "hello")
    recorded = {1: [turn]}
    changed = render(chat, [*first, {"role": "assistant", "content": "hello!"}], recorded=recorded)
    assert changed.edits == ["messages[1]: its content differs from every reply returned at this position (edited)"]
    assert not any(changed.mask)
    moved = [{"role": "user", "content": "say hell"}, {"role": "assistant", "content": "hello"}]
    out = render(chat, moved, recorded=recorded)
    assert out.edits == ["messages[1]: the conversation before it changed since it was sampled"]
    assert not any(out.mask)
    shifted = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"},
               {"role": "assistant", "content": "hello"}]  # the same reply again, where none was returned
    out = render(chat, shifted, recorded=recorded)
    assert out.edits == ["messages[3]: no reply of this session was returned at this position"]
    assert out.mapped == [turn]  # the first one maps, at its own position


def test_two_identical_replies_map_by_position(chat: ChatFormat) -> None:
    first: list[dict[str, Any]] = [{"role": "user", "content": "say hello"}]
    a = sampled(chat, render(chat, first).ids + list(chat.model_header), "hello")
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    b = sampled(chat, render(chat, second, recorded={1: [a]}).ids + list(chat.model_header), "hello", position=3)
    out = render(chat, [*second, {"role": "assistant", "content": "hello"}], recorded={1: [a], 3: [b]})
    assert out.edits == [] and out.mapped == [a, b]
