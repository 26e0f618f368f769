"""litellm's OpenAI-compatible provider (``openai/<model>`` with ``api_base``) against the gateway: a tool
call forced with ``tool_choice="required"``, the reply's message sent back as litellm returns it
(``model_dump()``: the fields OpenAI's responses carry), the tool's result, and the answer."""

from __future__ import annotations

import json

import litellm
from common import API_KEY, BASE_URL, MODEL, PREFIX, close, report

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def main() -> None:
    sessions, outputs = [], []
    for n in range(1):
        session = f"{PREFIX}-litellm-{n}"
        common = {"model": f"openai/{MODEL}", "api_base": BASE_URL, "api_key": API_KEY, "temperature": 0,
                  "extra_headers": {"X-RL-Session": session}, "num_retries": 0}
        messages: list = [{"role": "user", "content": f"What is the weather in {['Oslo', 'Paris'][n]}?"}]
        first = litellm.completion(messages=messages, tools=TOOLS, tool_choice="required", max_tokens=40, **common)
        message = first.choices[0].message
        [call] = message.tool_calls
        city = json.loads(call.function.arguments).get("city")
        messages += [message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": f"rain in {city}"}]
        second = litellm.completion(messages=messages, tools=TOOLS, max_tokens=16, **common)
        outputs.append(second.choices[0].message.content)
        sessions.append({"id": session, "receipt": close(session, 0.5)})
    report(client="litellm", sessions=sessions, outputs=outputs)


main()
