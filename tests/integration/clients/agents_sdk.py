"""The OpenAI Agents SDK with its defaults — the Responses API, streamed, a function tool — against the
gateway. Two knobs only: the client (base URL and token) and the session header; tracing, which uploads to
OpenAI's platform, is off. The episode is two runs in one session: the first must call the tool
(``tool_choice="required"``: constrained decoding) and stops on it; the second continues from the first's
items (``to_input_list()``: the SDK's own echo of the response items) and answers without tools. A reply cut
by ``max_tokens`` is ``status: incomplete``, which the SDK raises on (as it does against OpenAI): the
budgets leave room for the model to end its turn."""

from __future__ import annotations

import asyncio

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from common import API_KEY, BASE_URL, MODEL, PREFIX, close, report
from openai import AsyncOpenAI


@function_tool
def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"rain, 4 C in {city}"


async def run(agent: Agent, items: str | list, counts: dict[str, int]):  # type: ignore[no-untyped-def]
    result = Runner.run_streamed(agent, items, max_turns=2)
    async for event in result.stream_events():
        counts["events"] += 1
        if event.type == "run_item_stream_event" and event.name == "tool_called":
            counts["tools_called"] += 1
    return result


async def main() -> None:
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0))
    session = f"{PREFIX}-agents-0"
    settings = {"temperature": 0, "extra_headers": {"X-RL-Session": session}}
    counts = {"events": 0, "tools_called": 0}
    caller = Agent(name="weather", instructions="Use the tool.", model=MODEL, tools=[get_weather],
                   tool_use_behavior="stop_on_first_tool",
                   model_settings=ModelSettings(tool_choice="required", max_tokens=40, **settings))
    first = await run(caller, "What is the weather in Oslo?", counts)
    answerer = caller.clone(tools=[], tool_use_behavior="run_llm_again",
                            model_settings=ModelSettings(max_tokens=48, **settings))
    second = await run(answerer, [*first.to_input_list(), {"role": "user", "content": "Say it in a sentence."}],
                       counts)
    report(client="openai-agents", sessions=[{"id": session, "receipt": close(session, 1.0)}],
           outputs=[str(first.final_output), str(second.final_output)], **counts)


asyncio.run(main())
