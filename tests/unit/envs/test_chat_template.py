"""ChatFormat from a chat template: derived pieces, render_messages against apply_chat_template, masks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlbus.envs.chat import ChatFormat
from rlbus.errors import ConfigError
from rlbus.models.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from tests.fixtures.hf import offline_tokenizer

TOOL = {"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "calc", "arguments": {"input": "2+3"}}\n</tool_call>'},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ],
    [
        {"role": "user", "content": "inner  spaces and\nnewlines\n\n"},
        {"role": "assistant", "content": "ok \n"},
        {"role": "tool", "content": '{"json": [1, 2]}'},
        {"role": "tool", "content": "second"},
        {"role": "user", "content": "héllo wörld ✓"},
        {"role": "assistant", "content": "done"},
    ],
]


def test_a_content_opening_with_whitespace_is_tokenised_apart_from_its_header(smollm2_tokenizer: Any) -> None:
    """The known limit of appending: SmolLM2's tokenizer merges the header's newline with leading spaces."""
    chat = ChatFormat.for_hf_tokenizer(smollm2_tokenizer)
    messages = [{"role": "user", "content": "  indented"}]
    ids, _ = chat.render_messages(messages)
    assert ids != reference(smollm2_tokenizer, messages)
    assert smollm2_tokenizer.decode(ids) == smollm2_tokenizer.apply_chat_template(messages, tokenize=False)


def reference(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def assert_mask_on_assistant_content(chat: ChatFormat, messages: list[dict[str, Any]], mask: list[bool]) -> None:
    """Trained tokens are exactly each assistant content plus its end-of-turn token, in order."""
    ids, _ = chat.render_messages(messages)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    expected = [t for m in messages if m["role"] == "assistant" for t in (*chat.encode(m["content"]), chat.turn_end)]
    assert trained == expected
    runs = sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))
    assert runs == sum(m["role"] == "assistant" for m in messages)


def test_smollm2_pieces_come_from_its_template(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    chat = ChatFormat.for_hf_tokenizer(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    newline = tok.encode("\n", add_special_tokens=False)
    assert chat.end_of_turn == im_end == tok.eos_token_id  # SmolLM2's eos is <|im_end|> too
    assert chat.stop_ids == (im_end,)
    assert chat.bos == ()  # its bos_token is <|im_start|>, the token every turn opens with
    assert chat.header("user") == (im_start, *tok.encode("user\n", add_special_tokens=False))
    assert chat.closing("user") == (im_end, *newline) and chat.closing("assistant") == tuple(newline)
    assert chat.model_header == chat.header("assistant")
    assert chat.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert chat.actions == "native" and chat.tool_template is None  # its template ignores tools=


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_render_messages_reproduces_apply_chat_template(
    smollm2_tokenizer: Any, messages: list[dict[str, Any]]
) -> None:
    chat = ChatFormat.for_hf_tokenizer(smollm2_tokenizer)
    ids, mask = chat.render_messages(messages)
    assert ids == reference(smollm2_tokenizer, messages)
    assert_mask_on_assistant_content(chat, messages, mask)


def test_smollm2_tools_go_into_a_hermes_system_prompt(smollm2_tokenizer: Any) -> None:
    chat = ChatFormat.for_hf_tokenizer(smollm2_tokenizer)
    system = chat.system_text(None, [TOOL])
    assert system is not None and system.startswith(chat.default_system or "?")
    block = system[system.index("<tools>\n") + len("<tools>\n") : system.index("\n</tools>")]
    assert [json.loads(line) for line in block.splitlines()] == [TOOL["function"]]
    assert "<tool_call>" in system
    ids, _ = chat.render_messages([{"role": "user", "content": "add"}], tools=[TOOL])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "add"}]
    assert ids == reference(smollm2_tokenizer, messages)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("which", ["chatml", "tools"])
def test_offline_templates_are_reproduced(
    which: str, messages: list[dict[str, Any]], chatml_tokenizer: Any, tools_tokenizer: Any
) -> None:
    tok = chatml_tokenizer if which == "chatml" else tools_tokenizer
    chat = ChatFormat.for_hf_tokenizer(tok)
    ids, mask = chat.render_messages(messages)
    assert ids == reference(tok, messages)
    assert_mask_on_assistant_content(chat, messages, mask)


def test_plain_chatml_has_no_default_system(chatml_tokenizer: Any) -> None:
    chat = ChatFormat.for_hf_tokenizer(chatml_tokenizer)
    assert chat.default_system is None and chat.system_text(None) is None
    ids, mask = chat.render_messages([{"role": "user", "content": "hi"}])
    assert chatml_tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n" and not any(mask)


def test_a_template_that_renders_tools_gets_its_own_rendering(tools_tokenizer: Any) -> None:
    chat = ChatFormat.for_hf_tokenizer(tools_tokenizer)
    assert chat.tool_template is not None and chat.default_system == "You are helpful."
    tool_open = tools_tokenizer.decode(chat.header("tool"))
    assert tool_open == "<|im_start|>user\n<tool_response>\n"  # derived, not assumed
    for system in (None, "Be brief."):
        messages = [{"role": "user", "content": "add 2 and 3"}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        ids, _ = chat.render_messages(messages, tools=[TOOL])
        assert ids == reference(tools_tokenizer, messages, tools=[TOOL])
        text = chat.system_text(system, [TOOL])
        assert text is not None and text.startswith(system or "You are helpful.") and '"calc"' in text


def test_assistant_tool_calls_render_as_tool_call_blocks(chatml_tokenizer: Any) -> None:
    chat = ChatFormat.for_hf_tokenizer(chatml_tokenizer)
    call = {"type": "function", "function": {"name": "calc", "arguments": '{"input": "2+3"}'}}
    ids, mask = chat.render_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    trained = chatml_tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == '<tool_call>\n{"name": "calc", "arguments": {"input": "2+3"}}\n</tool_call><|im_end|>'


def test_contents_cannot_forge_special_tokens(chatml_tokenizer: Any) -> None:
    chat = ChatFormat.for_hf_tokenizer(chatml_tokenizer)
    ids = chat.encode("<|im_end|>")
    assert chat.turn_end not in ids and chatml_tokenizer.decode(ids) == "<|im_end|>"


def test_templates_that_cannot_be_appended_piecewise_are_refused() -> None:
    rewrites = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ConfigError, match="verbatim"):
        ChatFormat.for_hf_tokenizer(offline_tokenizer(rewrites))
    no_turn_end = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match="special token"):
        ChatFormat.for_hf_tokenizer(offline_tokenizer(no_turn_end))


def test_byte_format_render_messages() -> None:
    tok = ByteTokenizer()
    chat = ChatFormat.for_byte_tokenizer(tok)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t"},
    ]
    ids, mask = chat.render_messages(messages)
    system, user, assistant, tool = (
        tok.token_id(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|tool_result|>")
    )
    assert ids == [BOS_ID, system, ord("s"), user, ord("u"), assistant, ord("a"), EOS_ID, tool, ord("t")]
    assert mask == [False] * 6 + [True, True] + [False] * 2
    with pytest.raises(ValueError, match="tagged"):
        chat.render_messages(messages, tools=[TOOL])
