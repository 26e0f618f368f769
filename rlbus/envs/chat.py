"""How an episode's messages become token ids: role headers and closings, the action formats, parsing.

Every message is its role's opening ids, its content, and its role's closing ids; the model's turn is the
generation prompt (the ``assistant`` opening) followed by whatever the model sampled, its end-of-turn
token included. Openings and closings are environment tokens (masked in training); only sampled tokens are
trained. Contents are tokenised on their own and appended — a context only ever grows by appending ids,
never by re-tokenising decoded text — and special-token strings inside a content stay text, so a tool
printing ``<|assistant|>`` or ``<|im_end|>`` cannot forge a turn.

Two kinds of format:

* **Byte** (`ChatFormat.for_byte_tokenizer`, the in-repo model): the openings are the byte tokenizer's role
  tokens (``<|user|>``, ``<|assistant|>``, ``<|tool_result|>`` …), nothing closes a message, and the model
  ends its turn with EOS. Actions use the tagged format below. `ChatFormat.plain` gives any other tokenizer
  plain-text headers.
* **Chat template** (`ChatFormat.for_hf_tokenizer`, a Hugging Face tokenizer): openings, closings, the
  end-of-turn token, the generation prompt and any default system message are derived from the template
  itself, by rendering conversations whose contents are sentinels and splitting the text around them (no
  family is hard-coded). The result reproduces ``apply_chat_template(messages, tokenize=True)`` for
  ordinary conversations (checked when the format is built). A turn the model did not end itself (a stop
  string, the token budget) is still closed with the end-of-turn token, masked, because the template
  needs every turn closed. When the first message is not a system message, templates that insert a
  default system prompt (SmolLM2: "You are a helpful AI assistant named SmolLM …") get it here too, so the
  model sees the prompt it was tuned with; a system message of the environment replaces it, as in the
  template. Templates have no ``summary`` role: a summary is a ``user`` message. Actions use native tool
  calls (`rlbus.envs.tool_calls`).

Tagged actions are text tags the model writes in its turn (the first complete tag counts):

    <tool name="NAME">INPUT</tool>     call tool NAME with INPUT (free text, may span lines)
    <answer>TEXT</answer>              the final answer; ends the episode
    <summary>TEXT</summary>            only when asked to summarize: the summary to continue from

A turn with none of them, or with a half-written one, is not an error of the harness: the model gets an
observation saying what is wrong and may try again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rlbus.envs.actions import Action, Answer, Malformed, ToolCall
from rlbus.errors import ConfigError
from rlbus.models.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from rlbus.envs.tool_calls import CallHelp

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

Message = Mapping[str, Any]
"""A chat message as datasets and ``apply_chat_template`` write it: ``role``, ``content``, optionally
``tool_calls`` (OpenAI format) on an assistant message."""
ToolSchema = Mapping[str, Any]
"""A tool's JSON schema in OpenAI function format (`rlbus.envs.tool_calls.tool_schema`)."""


class Tokenizer(Protocol):
    """The part of a tokenizer the harness needs (`rlbus.models.tokenizer.ByteTokenizer` is one)."""

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ChatTemplate(Tokenizer, Protocol):
    """A tokenizer with a chat template (`rlbus.models.hf_tokenizer.HFTokenizer` is one)."""

    @property
    def bos_text(self) -> str | None: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def encode_template(self, text: str) -> list[int]: ...

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[ToolSchema] | None = None,
        add_generation_prompt: bool = False,
    ) -> str: ...


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer plus each role's opening and closing ids, the ids that open a context, the action format."""

    tokenizer: Tokenizer
    headers: Mapping[str, tuple[int, ...]]
    """Opening ids of each role's message."""
    bos: tuple[int, ...] = ()
    closings: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Ids after a message's content; for ``assistant``, after its end-of-turn token. Empty: none."""
    end_of_turn: int | None = None
    """The token a model turn ends with, which the engine stops on; None: the tokenizer's EOS."""
    generation_prompt: tuple[int, ...] | None = None
    """What a model turn opens with in the agent loop; None: the ``assistant`` opening."""
    close_cut_turns: bool = False
    """Close a turn the model did not end itself with the end-of-turn token (masked). Templates need every
    turn closed; the byte format's role tokens delimit turns on their own."""
    default_system: str | None = None
    """The system message a conversation without one gets (the template's default system prompt)."""
    actions: Literal["tagged", "native"] = "tagged"
    """``tagged``: ``<tool name=…>`` tags, tools listed in the instructions; ``native``: ``<tool_call>`` JSON."""
    tool_template: TemplateTools | None = field(default=None, compare=False)
    """Set when the template renders ``tools=`` itself; None: native tools go in a Hermes system prompt."""

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

    @classmethod
    def for_hf_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        """The format of a tokenizer's chat template: a ``transformers`` tokenizer or a `ChatTemplate`.

        Raises ConfigError when the template cannot be expressed as appended per-role pieces (it rewrites
        contents, refuses a role, or its pieces do not reproduce its own ids).
        """
        if not hasattr(tokenizer, "encode_template"):
            from rlbus.models.hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer(tokenizer)
        return _derive(tokenizer)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def turn_end(self) -> int:
        return self.eos_id if self.end_of_turn is None else self.end_of_turn

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids the engine stops a model turn on: the end-of-turn token, and EOS if it differs."""
        return tuple(dict.fromkeys((self.turn_end, self.eos_id)))

    @property
    def model_header(self) -> tuple[int, ...]:
        return self.header("assistant") if self.generation_prompt is None else self.generation_prompt

    @property
    def action_stops(self) -> tuple[str, ...]:
        if self.actions == "native":
            from rlbus.envs.tool_calls import NATIVE_STOPS

            return NATIVE_STOPS
        return ACTION_STOPS

    def parse(self, text: str, structured: Container[str] = (), hint: CallHelp | None = None) -> Action:
        """The action of a model turn in this format's action syntax (``structured``: tools whose native
        calls keep their whole arguments object; ``hint``: what a malformed native turn is told,
        `rlbus.envs.tool_calls.parse_native_action`)."""
        if self.actions == "native":
            from rlbus.envs.tool_calls import CallHelp, parse_native_action

            return parse_native_action(text, structured, hint or CallHelp())
        return parse_action(text)

    def header(self, role: str) -> tuple[int, ...]:
        try:
            return self.headers[role]
        except KeyError:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(self.headers)}") from None

    def closing(self, role: str) -> tuple[int, ...]:
        return self.closings.get(role, ())

    def framing(self, role: str) -> int:
        """Tokens a message of ``role`` costs besides its content."""
        return len(self.header(role)) + len(self.closing(role))

    def turn_closing(self, sampled: Sequence[int]) -> tuple[int, ...]:
        """Ids appended (masked) after a model turn: the rest of its closing, or all of it when cut short."""
        if sampled and sampled[-1] in self.stop_ids:
            return self.closing("assistant")
        if self.close_cut_turns:
            return (self.turn_end, *self.closing("assistant"))
        return ()

    def turn_reserve(self) -> int:
        """Tokens a model turn may take besides what it samples: its opening and what closes it."""
        closing = len(self.closing("assistant")) + (1 if self.close_cut_turns else 0)
        return len(self.model_header) + closing

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of sampled ids, without the stop token."""
        stops = set(self.stop_ids)
        return self.tokenizer.decode([i for i in ids if i not in stops])

    def message_ids(self, role: str, content: str) -> list[int]:
        """An environment message: opening, content, closing."""
        return [*self.header(role), *self.encode(content), *self.closing(role)]

    def system_text(self, system: str | None, tools: Sequence[ToolSchema] | None = None) -> str | None:
        """The system message's content for ``system`` (None: the default) and the tools' schemas."""
        base = self.default_system if system is None else system
        if not tools:
            return base
        if self.actions != "native":
            raise ValueError("the tagged format lists tools in the system text itself; pass no schemas")
        if self.tool_template is not None:
            return self.tool_template.system_text(system, tools)
        from rlbus.envs.tool_calls import hermes_tool_prompt

        return hermes_tool_prompt(tools) if not base else f"{base}\n\n{hermes_tool_prompt(tools)}"

    def render_messages(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSchema] | None = None
    ) -> tuple[list[int], list[bool]]:
        """A conversation's ids and its trained mask: True exactly on assistant contents and their
        end-of-turn tokens. A first ``system`` message (or the default one) carries the tools' schemas."""
        rest = list(messages)
        system = None
        if rest and rest[0]["role"] == "system":
            system = str(rest.pop(0)["content"])
        ids, mask = list(self.bos), [False] * len(self.bos)

        def add(part: Iterable[int], trained: bool) -> None:
            part = list(part)
            ids.extend(part)
            mask.extend([trained] * len(part))

        system = self.system_text(system, tools)
        if system is not None:
            add(self.message_ids("system", system), False)
        for message in rest:
            role, content = str(message["role"]), str(message.get("content") or "")
            if role != "assistant":
                add(self.message_ids(role, content), False)
                continue
            add(self.header("assistant"), False)
            add([*self.encode(content + calls_text(message.get("tool_calls"), content)), self.turn_end], True)
            add(self.closing("assistant"), False)
        return ids, mask


def calls_text(calls: Any, content: str) -> str:
    """An assistant message's OpenAI ``tool_calls`` as the ``<tool_call>`` blocks the model writes (as the
    template renders them). Arguments that are not a JSON object (a client's broken string) are kept as
    ``{"input": …}`` rather than refused: the text is history, not a call to run."""
    if not calls:
        return ""
    from rlbus.envs.tool_calls import format_native_call

    blocks = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        if not isinstance(arguments, dict):
            arguments = {"input": arguments}
        blocks.append(format_native_call(str(function.get("name", "")), arguments))
    return ("\n" if content else "") + "\n".join(blocks)


# -- deriving a chat template's pieces -------------------------------------------------------------------

_PROBE_ROLES = ("system", "user", "assistant", "tool", "assistant", "user", "assistant")
_SAMPLE = (
    ("system", "You are terse."),
    ("user", "What is 12 + 30? Use the calculator."),
    ("assistant", 'Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"input": "12+30"}}\n</tool_call>'),
    ("tool", "42"),
    ("assistant", "<answer>42</answer>"),
    ("user", "And doubled, in words?"),
    ("assistant", " Eighty-four.\n\nDone."),
)
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "rlbus_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
    },
}


def _sentinel(i: int) -> str:
    return f"rlbus-sentinel-{i}"


def _problem(problem: str) -> ConfigError:
    return ConfigError("tokenizer.chat_template", problem)


def _render(t: ChatTemplate, messages: Sequence[Message], **kwargs: Any) -> str:
    try:
        return t.render(messages, **kwargs)
    except Exception as exc:  # a template raising (e.g. a role it refuses) is a configuration problem
        raise _problem(f"rendering {[m['role'] for m in messages]} failed: {exc}") from exc


def _set(pieces: dict[str, str], role: str, text: str, what: str) -> None:
    if pieces.setdefault(role, text) != text:
        raise _problem(f"the {role} {what} differs between messages ({pieces[role]!r} vs {text!r})")


def _derive(t: ChatTemplate) -> ChatFormat:
    """Openings, closings, end-of-turn, generation prompt and default system of ``t``'s template."""
    msgs = [{"role": role, "content": _sentinel(i)} for i, role in enumerate(_PROBE_ROLES)]
    full = _render(t, msgs)
    spans: list[tuple[int, int]] = []
    for m in msgs:
        at = full.find(m["content"])
        if at < 0 or full.count(m["content"]) != 1 or (spans and at < spans[-1][1]):
            raise _problem(f"it does not render a {m['role']} message's content verbatim, once, in order")
        spans.append((at, at + len(m["content"])))

    closings: dict[str, str] = {}
    for k, m in enumerate(msgs):
        part = _render(t, msgs[: k + 1])
        if not full.startswith(part):
            raise _problem("rendering a longer conversation changes the text of earlier messages")
        _set(closings, m["role"], part[spans[k][1] :], "closing")
    openings: dict[str, str] = {}
    for k in range(1, len(msgs)):
        between = full[spans[k - 1][1] : spans[k][0]]
        previous = closings[msgs[k - 1]["role"]]
        if not between.startswith(previous):
            raise _problem(f"a {msgs[k]['role']} message changes how the message before it closes")
        _set(openings, msgs[k]["role"], between[len(previous) :], "opening")
    first = full[: spans[0][0]]
    # A BOS the template writes first opens the context, unless it is the token every turn opens with
    # (SmolLM2 names ChatML's <|im_start|> its BOS).
    bos = t.bos_text or ""
    if not first.startswith(bos) or openings["user"].startswith(bos):
        bos = ""
    _set(openings, "system", first[len(bos) :], "opening")

    history = _render(t, msgs[:6])
    generation = _render(t, msgs[:6], add_generation_prompt=True)
    if not generation.startswith(history):
        raise _problem("the generation prompt changes the text before it")
    default_system = _default_system(t, bos, openings, closings)

    eot_and_rest = t.encode_template(closings["assistant"])
    if not eot_and_rest or eot_and_rest[0] not in t.special_ids:
        raise _problem(f"an assistant turn does not end with a special token ({closings['assistant']!r})")
    plain = [{"role": "system", "content": _sentinel(0)}, {"role": "user", "content": _sentinel(1)}]
    native = _render(t, plain, tools=[_PROBE_TOOL]) != _render(t, plain)
    ids = {role: tuple(t.encode_template(text)) for role, text in openings.items()}
    closing_ids = {role: tuple(t.encode_template(text)) for role, text in closings.items()}
    closing_ids["assistant"] = tuple(eot_and_rest[1:])
    chat = ChatFormat(
        tokenizer=t,
        headers={**ids, "summary": ids["user"]},
        bos=tuple(t.encode_template(bos)),
        closings={**closing_ids, "summary": closing_ids["user"]},
        end_of_turn=eot_and_rest[0],
        generation_prompt=tuple(t.encode_template(generation[len(history) :])),
        close_cut_turns=True,
        default_system=default_system,
        actions="native",
        tool_template=TemplateTools(t, bos, openings["system"], closings["system"] + openings["user"])
        if native
        else None,
    )
    _check_reproduces(chat, t)
    return chat


def _default_system(t: ChatTemplate, bos: str, openings: dict[str, str], closings: dict[str, str]) -> str | None:
    """The system content the template inserts before a first message that is not a system message."""
    alone = _render(t, [{"role": "user", "content": _sentinel(1)}])
    before = alone[: alone.find(_sentinel(1))]
    if not (before.startswith(bos) and before.endswith(openings["user"])):
        raise _problem(f"a conversation opening with a user message renders unexpectedly ({before!r})")
    extra = before[len(bos) : len(before) - len(openings["user"])]
    if not extra:
        return None
    opening, closing = openings["system"], closings["system"]
    if not (extra.startswith(opening) and extra.endswith(closing)):
        raise _problem(f"the text it inserts before a first user message is not a system message ({extra!r})")
    return extra[len(opening) : len(extra) - len(closing)]


@dataclass(frozen=True)
class TemplateTools:
    """How a template that renders ``tools=`` itself writes them: into the system message's content."""

    template: ChatTemplate
    bos: str
    before: str
    """The system opening."""
    after: str
    """The system closing followed by the user opening."""

    def system_text(self, system: str | None, tools: Sequence[ToolSchema]) -> str:
        """The system content the template writes for ``system`` (None: its default) and ``tools``."""
        probe: list[Message] = [{"role": "user", "content": _sentinel(1)}]
        if system is not None:
            probe.insert(0, {"role": "system", "content": system})
        text = _render(self.template, probe, tools=list(tools))
        head = text[: text.find(_sentinel(1))]
        if not (head.startswith(self.bos + self.before) and head.endswith(self.after)):
            raise _problem(f"with tools, its system message renders unexpectedly ({head!r})")
        return head[len(self.bos + self.before) : len(head) - len(self.after)]


def _check_reproduces(chat: ChatFormat, t: ChatTemplate) -> None:
    messages = [{"role": role, "content": content} for role, content in _SAMPLE]
    for conversation in (messages, messages[1:]):
        ours, _ = chat.render_messages(conversation)
        theirs = t.encode_template(_render(t, conversation))
        if ours != theirs:
            raise _problem("its per-role pieces, appended, do not reproduce the ids of the whole rendering")


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
