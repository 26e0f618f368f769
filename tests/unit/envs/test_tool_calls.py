"""Native tool calls: schemas, the Hermes prompt, and parsing <tool_call> JSON into actions."""

from __future__ import annotations

import json

import pytest

from rlbus.envs.chat import Answer, Malformed, ToolCall
from rlbus.envs.tool_calls import CallHelp, format_native_call, hermes_tool_prompt, parse_native_action, tool_schema


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "action"),
    [
        (call('{"name": "calc", "arguments": {"input": "2+3"}}'), ToolCall("calc", "2+3")),
        (
            "think first " + call('{"name": "c", "arguments": {"input": "a\\nb"}}') + "<answer>1</answer>",
            ToolCall("c", "a\nb"),
        ),
        (
            call('{"name": "c", "arguments": "{\\"input\\": \\"x\\"}"}'),
            ToolCall("c", "x"),
        ),  # arguments as a JSON string
        ("<answer> 5 </answer>" + call('{"name": "c", "arguments": {"input": "x"}}'), Answer("5")),
        (format_native_call("nope", {"input": "x"}), ToolCall("nope", "x")),  # unknown tools: the loop answers
    ],
)
def test_parse_native_action(text: str, action: object) -> None:
    assert parse_native_action(text) == action


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (call('{"name": "calc", "arguments": {"input": "2+3"}'), "not valid JSON"),
        (call('["calc"]'), "must be a JSON object"),
        (call('{"arguments": {"input": "x"}}'), 'no "name"'),
        (call('{"name": "calc"}'), 'no "arguments"'),
        (call('{"name": "calc", "arguments": [1]}'), '"arguments" must be a JSON object'),
        (call('{"name": "calc", "arguments": {"x": 1}}'), 'string "input"'),
        ('<tool_call>{"name": "calc"', "unfinished tool call"),
        ("<answer>5", "malformed answer"),
        ("just talk", "no action"),
    ],
)
def test_malformed_calls_say_what_is_wrong(text: str, problem: str) -> None:
    action = parse_native_action(text)
    assert isinstance(action, Malformed) and problem in action.problem
    if "answer" not in problem:
        assert "<tool_call>" in action.problem  # and how to write it


def test_the_hint_calls_the_episodes_first_tool_with_its_required_arguments() -> None:
    edit = tool_schema("edit", "edits a file", {
        "type": "object", "required": ["path", "line", "text"],
        "properties": {"path": {"type": "string"}, "line": {"type": "integer"}, "text": {"type": "string"},
                       "dry_run": {"type": "boolean"}},
    })  # fmt: skip
    hint = CallHelp.of([edit, tool_schema("submit", "finish", {"type": "object", "properties": {}})], ["submit"])
    example = '<tool_call>{"name": "edit", "arguments": {"path": "PATH", "line": 1, "text": "TEXT"}}</tool_call>'
    assert hint.call == f"write {example} (tools: edit, submit)"
    assert parse_native_action(hint.call.removeprefix("write ").split(" (tools")[0], {"edit"}) == ToolCall(
        "edit", '{"path": "PATH", "line": 1, "text": "TEXT"}'
    )  # the example is itself a valid call
    no_action = parse_native_action("I will fix it.", {"edit"}, hint)
    assert isinstance(no_action, Malformed)
    assert no_action.problem == f"no action: {hint.call}; to finish, call submit"
    broken = parse_native_action(call('{"name": "edit", "arguments": 3}'), {"edit"}, hint)
    assert isinstance(broken, Malformed) and broken.problem.endswith("(tools: edit, submit)")
    plain = parse_native_action("hm", (), CallHelp.of([tool_schema("calc", "adds")]))
    assert isinstance(plain, Malformed) and plain.problem.endswith("; to finish, write <answer>ANSWER</answer>")
    assert '"name": "NAME"' not in plain.problem


def test_hermes_prompt_lists_one_signature_per_line() -> None:
    tools = [tool_schema("calc", "adds two integers"), tool_schema("get", "reads a key")]
    prompt = hermes_tool_prompt(tools)
    block = prompt[prompt.index("<tools>\n") + 8 : prompt.index("\n</tools>")]
    signatures = [json.loads(line) for line in block.splitlines()]
    assert [s["name"] for s in signatures] == ["calc", "get"]
    assert signatures[0]["parameters"]["required"] == ["input"]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt


def test_format_native_call_round_trips() -> None:
    assert parse_native_action(format_native_call("calc", {"input": "1 + 1"})) == ToolCall("calc", "1 + 1")
