"""Request validation names the parameter of every problem, as OpenAI's error bodies do."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlbus.errors import ApiError
from rlbus.serve.api import error_body, internal_messages, parse_request

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(**fields: Any) -> Any:
    return parse_request(json.dumps({**OK, **fields}).encode())


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"n": 9}, "n", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"n": "2"}, "n", "invalid_type"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value"),
    ({"logit_bias": {"42": 3.0}}, "logit_bias", "unsupported_value"),
    ({"best_of": 2}, "best_of", "unknown_parameter"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_value"),
    ({"function_call": "auto"}, "function_call", "unsupported_value"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_value"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_value"),
    ({"verbosity": "high"}, "verbosity", "invalid_type"),
    ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}]}, "messages[0].audio",
     "unsupported_value"),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call", "unsupported_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "invalid_value"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type",
     "unsupported_value"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "g"}}], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tool_choice", "invalid_value"),
])
def test_each_problem_names_its_parameter(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(**fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert caught.value.code == code, caught.value.message
    body = error_body(caught.value)["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_missing_model_and_bad_json() -> None:
    with pytest.raises(ApiError) as missing:
        parse_request(b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert (missing.value.param, missing.value.code) == ("model", "missing_required_parameter")
    with pytest.raises(ApiError) as broken:
        parse_request(b"{not json")
    assert broken.value.code == "invalid_json"


def test_messages_become_chat_messages() -> None:
    request = parse(messages=[
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
    ])
    assert [(m["role"], m["content"]) for m in internal_messages(request)] == [
        ("system", "rules"), ("user", "ab"), ("assistant", ""), ("tool", "out")]
    assert internal_messages(request)[2]["tool_calls"][0]["function"]["name"] == "f"


#: What an OpenAI response holds and a harness sends back in the next request (``message.model_dump()``).
ECHOED = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None,
          "function_call": None, "tool_calls": [{"id": "call_1", "index": 0, "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]}


def test_what_openai_responses_contain_is_accepted_when_echoed() -> None:
    request = parse(messages=[
        {"role": "system", "content": [{"type": "text", "text": "rules", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "capital?"}, ECHOED, {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "assistant", "content": None, "refusal": "No."},
    ])
    messages = internal_messages(request)
    assert [m["content"] for m in messages] == ["rules", "capital?", "Paris.", "ok", "I cannot.", "No."]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_the_no_op_request_fields_are_accepted() -> None:
    request = parse(store=True, reasoning_effort="low", service_tier="auto", prompt_cache_key="k",
                    prompt_cache_retention="24h", safety_identifier="u1", metadata={"task": "t"}, user="u",
                    parallel_tool_calls=False, response_format={"type": "text"}, modalities=["text"],
                    logit_bias={}, verbosity=None, prediction={"type": "content", "content": "Paris"},
                    stream_options={"include_usage": True, "include_obfuscation": False}, top_k=5)
    assert request.top_k == 5 and request.response_format is not None


def test_grammars_the_request_asks_for() -> None:
    from rlbus.serve.api import constraint_of, ends_at_first_call

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert constraint_of(parse()) is None and constraint_of(parse(response_format={"type": "text"})) is None
    assert constraint_of(parse(response_format={"type": "json_object"})).kind == "json"  # type: ignore[union-attr]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}
    assert json.loads(constraint_of(parse(response_format=schema)).source) == {"type": "array"}  # type: ignore[union-attr]
    required = constraint_of(parse(tools=tools, tool_choice="required", parallel_tool_calls=False))
    assert required is not None and required.kind == "lark" and 'call ("' not in required.source  # exactly one
    either = constraint_of(parse(tools=tools, response_format={"type": "json_object"}))
    assert either is not None and "start: answer | calls" in either.source
    assert ends_at_first_call(parse(tools=tools, parallel_tool_calls=False))
    assert not ends_at_first_call(parse(tools=tools)) and not ends_at_first_call(parse(parallel_tool_calls=False))
