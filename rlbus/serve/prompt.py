"""A chat request → the exact ids the engine is fed, with earlier turns mapped to the ids sampled.

Rendering follows the model's chat format piece by piece (`rlbus.envs.chat.ChatFormat`: BOS, the system
message carrying the tools' schemas, each message's opening, content and closing, then the generation
prompt), which reproduces the template's own rendering. What a template cannot know is what the model
actually sampled: decoding sampled ids to text and encoding the text again does not always give the
same ids back (byte-level BPE merges, a stop string cut mid-token), and training on re-tokenised turns
trains on tokens the policy never produced. So an assistant message the gateway itself returned in
this session is replaced by the turn it recorded — the sampled ids with their log-probs and versions —
provided the context before it is the one it was sampled under.

Turns are found by **position**, not content: a turn is recorded at the index its message takes in the
conversation (the number of messages it was sampled after), and the assistant message at index ``i`` maps
to a turn recorded at ``i`` whose reply it is (`rlbus.serve.api.turn_key`) and whose context is the one
rendered so far (a digest of the ids). So two identical replies at different places never stand in for
each other, and a turn sampled twice at one place (a retry) maps to whichever reply the client kept.

An assistant message that matches no recorded turn at its position, or whose context changed (the client
edited an earlier message), is rendered from its text and masked: it is not the policy's sample, so it is
not trained here (the sample itself still is, under the context it was sampled in: `rlbus.serve.sessions`).
Each such case is reported (``edits``), and the gateway passes it on to the client and the counters.
Outside a session there are no recorded turns and history is rendered as text, unreported.

A format whose actions are tagged (the in-repo byte model) lists tools in a Hermes block of the system
message, as native formats without a tools template do: the model may then write ``<tool_call>`` blocks,
which constrained decoding (``tool_choice`` ``required``) makes it do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.envs.chat import ChatFormat, Message, ToolSchema, calls_text
from rlbus.schemas import AllowedTokens, Turn
from rlbus.serve.api import turn_key


@dataclass(frozen=True)
class SampledTurn:
    """One completion the gateway returned in a session, as sampled."""

    key: str
    """`rlbus.serve.api.turn_key` of the message returned to the client."""
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    text: str
    finish_reason: str
    routed_experts: np.ndarray[Any, Any] | None = None
    """[L, P + N - 1, k] as the engine returned it, for router replay."""
    position: int = 0
    """The index its message takes in the conversation: how many messages it was sampled after."""
    allowed: np.ndarray[Any, Any] | None = None
    """[N, W] int32: the allowed-token masks of a constrained turn (`rlbus.engines.constraints`)."""

    @property
    def prompt_digest(self) -> str:
        return ids_digest(self.prompt_ids)


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int32).tobytes(), digest_size=16).hexdigest()


@dataclass
class Rendered:
    """A context as flat token-aligned lists (the layout of `rlbus.envs.episode.Episode`)."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    mapped: list[SampledTurn] = field(default_factory=list)
    """Recorded turns this context contains as sampled, in order."""
    edits: list[str] = field(default_factory=list)
    """Why assistant messages could not be mapped to sampled turns."""
    allowed: list[tuple[int, np.ndarray[Any, Any]]] = field(default_factory=list)
    """(first position, masks [n, W]) of every constrained run of sampled ids, in order."""

    def add(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_sampled(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                    allowed: np.ndarray[Any, Any] | None = None) -> None:
        if allowed is not None:
            self.allowed.append((len(self.ids), allowed))
        self.ids += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.versions += versions

    def allowed_tokens(self) -> AllowedTokens | None:
        """The masks of the constrained runs as a rollout carries them (None: nothing was constrained)."""
        if not self.allowed:
            return None
        positions = np.concatenate([np.arange(p, p + len(bits)) for p, bits in self.allowed])
        return AllowedTokens.pack(positions, np.concatenate([bits for _, bits in self.allowed]))

    def turn(self, role: str, text: str, start: int) -> None:
        self.turns.append(Turn(role=role, text=text, start=start, end=len(self.ids)))

    def copy(self) -> Rendered:
        return Rendered(list(self.ids), list(self.mask), list(self.logprobs), list(self.versions),
                        list(self.turns), list(self.mapped), list(self.edits), list(self.allowed))


def render(
    chat: ChatFormat,
    messages: Sequence[Message],
    *,
    tools: Sequence[ToolSchema] | None = None,
    recorded: Mapping[int, Sequence[SampledTurn]] | None = None,
) -> Rendered:
    """The context for the next model turn: ``messages`` then the generation prompt (not yet sampled);
    ``recorded`` holds a session's sampled turns by position (module docstring)."""
    out = Rendered()
    rest = list(messages)
    offset = 1 if rest and rest[0]["role"] == "system" else 0
    system = str(rest.pop(0)["content"]) if offset else None
    system = system_text(chat, system, tools)
    start = 0
    out.add(chat.bos)
    if system is not None:
        out.add(chat.message_ids("system", system))
        out.turn("system", system, start)
    for i, message in enumerate(rest):
        role, content = str(message["role"]), str(message.get("content") or "")
        start = len(out.ids)
        if role != "assistant":
            out.add(chat.message_ids(role, content))
            out.turn(role, content, start)
            continue
        position = i + offset
        candidates = () if recorded is None else recorded.get(position, ())
        key, digest = turn_key(content, message.get("tool_calls")), ids_digest([*out.ids, *chat.model_header])
        turn = next((t for t in reversed(candidates) if t.key == key and t.prompt_digest == digest), None)
        if turn is not None:
            out.add(chat.model_header)
            out.add_sampled(turn.token_ids, turn.logprobs, turn.versions, turn.allowed)
            out.add(chat.turn_closing(turn.token_ids))
            out.mapped.append(turn)
            out.turn("assistant", turn.text, start)
            continue
        if recorded is not None:
            out.edits.append(f"messages[{position}]: " + _unmapped(candidates, key, digest))
        text = content + calls_text(message.get("tool_calls"), content)
        out.add([*chat.header("assistant"), *chat.encode(text), chat.turn_end, *chat.closing("assistant")])
        out.turn("assistant", content, start)
    return out




def _unmapped(candidates: Sequence[SampledTurn], key: str, digest: str) -> str:
    """Why an assistant message maps to none of the turns recorded at its position."""
    if not candidates:
        return "no reply of this session was returned at this position"
    if any(t.key == key for t in candidates):
        return "the conversation before it changed since it was sampled"
    return "its content differs from every reply returned at this position (edited)"


def system_text(chat: ChatFormat, system: str | None, tools: Sequence[ToolSchema] | None) -> str | None:
    """The system message with the tools: the format's own way, or a Hermes block for a tagged format."""
    if not tools or chat.actions == "native":
        return chat.system_text(system, tools)
    from rlbus.envs.tool_calls import hermes_tool_prompt

    base = chat.system_text(system)
    return hermes_tool_prompt(tools) if not base else f"{base}\n\n{hermes_tool_prompt(tools)}"
