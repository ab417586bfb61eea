"""A real agent framework end to end: the `openai-agents` SDK's run loop (model -> tool call -> the tool runs ->
the result back -> the answer) against the server, in its Responses mode (its default) and its chat completions
mode, on scripted outputs; the second turn's prompt is served from the prefix cache."""

from __future__ import annotations

import asyncio

import agents  # the openai-agents package (test extra)
import openai
import pytest

MODEL = "qwen-tools"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 18 C in Paris."


@agents.function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"18 C in {city}"


@pytest.mark.parametrize("mode", ["responses", "chat"])
def test_tool_loop(tool_server, mode):
    agents.set_tracing_disabled(True)  # nothing leaves this machine
    client = openai.AsyncOpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0)
    if mode == "responses":
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="weather", instructions=f"Agent test ({mode}): report the weather.", model=model,
                         tools=[get_weather])  # fmt: skip
    tool_server.script.push(CALL, ANSWER)
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?"))
    assert result.final_output == ANSWER and tool_server.script.pending() == 0
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == ["18 C in Paris"]
    first, second = result.raw_responses
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16 > 0
