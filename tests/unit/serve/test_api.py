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
    ({"logit_bias": {}}, "logit_bias", "unknown_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type",
     "unsupported_value"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "unsupported_value"),
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
