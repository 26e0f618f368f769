"""Native tool calls for chat-template models: JSON tool schemas, the Hermes tool prompt, and parsing.

A Hugging Face chat model calls a tool the way its template family was tuned to (Hermes / Qwen2.5 style):

    <tool_call>
    {"name": "NAME", "arguments": {"input": "INPUT"}}
    </tool_call>

Every rlbus `Tool` takes one free-text INPUT (``Tool.run(str)``), so its JSON schema has exactly one
required string parameter, ``input``; the call's ``arguments.input`` is what ``run`` receives. A template
that renders ``tools=`` itself (Qwen2.5, Llama 3.1 …) gets these schemas; for one that ignores them
(SmolLM2's) `hermes_tool_prompt` writes them into the system message — one JSON function signature per line
inside ``<tools>…</tools>``, with the instruction to answer in ``<tool_call>`` blocks.

The final answer stays the text tag ``<answer>…</answer>``: chat templates have no "final answer" message
of their own (an assistant turn without a tool call is just text), and the verifiers need an unambiguous
span to score — the same one the tagged format uses, so rewards read both formats alike.

A turn whose first action is a broken call (bad JSON, no name, no arguments, arguments not an object, no
string ``input``) is `Malformed`: the model gets the problem as the tool message and may try again. A call
of a tool the episode does not have is answered by the agent loop, as in the tagged format.

What the problem message shows (`CallHelp`) is built from the episode's own tools: a call of its first
tool with that tool's required arguments, the names of all of them, and how to finish (``<answer>``, or
the episode's ``final`` tool). A generic ``{"name": "NAME", "arguments": {"input": "INPUT"}}`` was copied
verbatim by SmolLM2-135M — all 8 of its parsed calls in the swe bench went to a tool named ``NAME`` — and
is wrong for tools with their own parameters and for an episode that ends with ``submit``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbus.envs.actions import Action, Answer, Malformed, ToolCall

#: Stop strings for a native-format turn: the first complete call or answer ends it.
NATIVE_STOPS = ("</tool_call>", "</answer>")

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
#: Placeholder values of a JSON-schema type in an example call.
_PLACEHOLDERS: dict[str, Any] = {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


@dataclass(frozen=True)
class CallHelp:
    """How a malformed turn is told to act: ``call`` shows a call, ``finish`` how to end the episode."""

    call: str = 'write <tool_call>{"name": "NAME", "arguments": {"input": "INPUT"}}</tool_call>'
    finish: str = "write <answer>ANSWER</answer>"

    @classmethod
    def of(cls, tools: Sequence[Mapping[str, Any]], final: Sequence[str] = ()) -> CallHelp:
        """From the episode's tool schemas (`tool_schema`) and the names of its ``final`` tools: a call of
        the first tool with its required arguments (strings as their upper-cased names), then every
        tool's name; the episode ends with a call of a final tool, else with ``<answer>``."""
        if not tools:
            return cls(call="this episode has no tools")
        functions = [t.get("function", t) for t in tools]
        first = functions[0]
        schema = first.get("parameters") or {}
        properties = schema.get("properties", {})
        arguments = {
            name: _PLACEHOLDERS.get(properties.get(name, {}).get("type", "string"), name.upper())
            for name in schema.get("required", [])
        }
        example = format_native_call(first["name"], arguments).replace("\n", "")
        call = f"write {example} (tools: {', '.join(f['name'] for f in functions)})"
        return cls(call=call, finish=f"call {' or '.join(final)}") if final else cls(call=call)


def tool_schema(name: str, description: str, parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema (OpenAI function format) of an rlbus tool: one required string ``input``, or the
    tool's own ``parameters`` schema."""
    default = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "the tool's input, as free text"}},
        "required": ["input"],
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": dict(parameters or default)},
    }


def hermes_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes tool block for a system message, for templates that do not render ``tools=``."""
    signatures = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def format_native_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as the model writes it (and as Hermes-style templates render an assistant's ``tool_calls``)."""
    call = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def parse_native_action(text: str, structured: Container[str] = (), hint: CallHelp = CallHelp()) -> Action:
    """The first complete ``<tool_call>`` or ``<answer>`` of a turn, or what is wrong with it (with
    ``hint``: how to call the episode's tools).

    A call of a tool named in ``structured`` (one with its own parameters schema) keeps its whole
    ``arguments`` object, as JSON text, for the tool to validate."""
    call, answer = _TOOL_CALL.search(text), _ANSWER.search(text)
    if call and (answer is None or call.start() < answer.start()):
        return _parse_call(call.group(1), structured, hint.call)
    if answer:
        return Answer(text=answer.group(1).strip())
    if "<tool_call" in text:
        return Malformed(f"unfinished tool call: {hint.call}")
    if "<answer" in text:
        return Malformed("malformed answer: write <answer>ANSWER</answer>")
    return Malformed(f"no action: {hint.call}; to finish, {hint.finish}")


def _parse_call(body: str, structured: Container[str], how: str) -> Action:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return Malformed(f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {how}")
    if not isinstance(call, dict):
        return Malformed(f"tool call must be a JSON object: {how}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return Malformed(f'tool call has no "name": {how}')
    if "arguments" not in call:
        return Malformed(f'tool call has no "arguments": {how}')
    arguments = call["arguments"]
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return Malformed(f'"arguments" must be a JSON object: {how}')
    if name in structured:
        return ToolCall(name=name, argument=json.dumps(arguments, ensure_ascii=False))
    argument = arguments.get("input")
    if not isinstance(argument, str):
        return Malformed(f'"arguments" must have a string "input": {how}')
    return ToolCall(name=name, argument=argument)
