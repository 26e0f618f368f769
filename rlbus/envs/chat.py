"""How an episode's messages become token ids: role headers, the tagged action format, and parsing it.

Every message is its role header followed by its text; the model's turn is the ``assistant`` header
followed by whatever the model sampled (its stop token included). Headers are environment tokens (masked
in training); only sampled tokens are trained. With the in-repo byte tokenizer the headers are its special
tokens (``<|user|>``, ``<|assistant|>``, ``<|tool_result|>`` …), which text can never produce, so a tool
printing ``<|assistant|>`` cannot forge a turn; any other tokenizer gets plain-text headers.

Actions are text tags the model writes in its turn (the first complete tag counts):

    <tool name="NAME">INPUT</tool>     call tool NAME with INPUT (free text, may span lines)
    <answer>TEXT</answer>              the final answer; ends the episode
    <summary>TEXT</summary>            only when asked to summarize: the summary to continue from

A turn with none of them, or with a half-written one, is not an error of the harness: the model gets an
observation saying what is wrong and may try again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rlbus.models.tokenizer import ByteTokenizer

ROLES = ("system", "user", "assistant", "tool", "summary")
#: Stop strings the engine should stop on, so the model does not keep writing past its action.
ACTION_STOPS = ("</tool>", "</answer>")
SUMMARY_STOPS = ("</summary>",)

_TOOL = re.compile(r'<tool\s+name\s*=\s*"([^"<>]*)"\s*>(.*?)</tool>', re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SUMMARY = re.compile(r"<summary>(.*?)</summary>", re.DOTALL)
_BYTE_HEADERS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool_result|>",
    "summary": "<|summary|>",
}


class Tokenizer(Protocol):
    """The part of a tokenizer the harness needs (`rlbus.models.tokenizer.ByteTokenizer` is one)."""

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer plus the header ids of each role and the ids that open a context."""

    tokenizer: Tokenizer
    headers: Mapping[str, tuple[int, ...]]
    bos: tuple[int, ...] = ()

    @classmethod
    def for_byte_tokenizer(cls, tokenizer: ByteTokenizer | None = None) -> ChatFormat:
        tok = tokenizer or ByteTokenizer()
        headers = {role: (tok.token_id(tag),) for role, tag in _BYTE_HEADERS.items()}
        return cls(tokenizer=tok, headers=headers, bos=(tok.bos_id,))

    @classmethod
    def plain(cls, tokenizer: Tokenizer, *, bos: tuple[int, ...] = ()) -> ChatFormat:
        """Text headers (``\\n<|user|>\\n`` …) for tokenizers without role tokens of their own."""
        headers = {role: tuple(tokenizer.encode(f"\n<|{role}|>\n")) for role in ROLES}
        return cls(tokenizer=tokenizer, headers=headers, bos=bos)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def header(self, role: str) -> tuple[int, ...]:
        try:
            return self.headers[role]
        except KeyError:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(self.headers)}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of sampled ids, without the stop token."""
        return self.tokenizer.decode([i for i in ids if i != self.eos_id])


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Malformed:
    """A turn with no complete action; ``problem`` is the observation the model gets back."""

    problem: str


Action = ToolCall | Answer | Malformed


def parse_action(text: str) -> Action:
    """The first complete ``<tool>`` or ``<answer>`` tag of a model turn, or what is wrong with it."""
    tool, answer = _TOOL.search(text), _ANSWER.search(text)
    if tool and (answer is None or tool.start() < answer.start()):
        return ToolCall(name=tool.group(1).strip(), argument=tool.group(2).strip())
    if answer:
        return Answer(text=answer.group(1).strip())
    if "<tool" in text:
        return Malformed('malformed tool call: write <tool name="NAME">INPUT</tool>')
    if "<answer" in text:
        return Malformed("malformed answer: write <answer>ANSWER</answer>")
    return Malformed('no action: write <tool name="NAME">INPUT</tool> or <answer>ANSWER</answer>')


def parse_summary(text: str) -> str:
    """The text inside ``<summary>…</summary>``, or the whole turn when the model left the tags out."""
    found = _SUMMARY.search(text)
    if found:
        return found.group(1).strip()
    return text.replace("<summary>", "").strip()


def format_tool_call(name: str, argument: str) -> str:
    return f'<tool name="{name}">{argument}</tool>'


def format_answer(text: str) -> str:
    return f"<answer>{text}</answer>"
