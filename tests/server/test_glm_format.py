"""GLM-4.5's tool calls and reasoning through the three chat APIs (chat completions, Responses, Anthropic Messages),
whole and streamed, on the demo model dressed in GLM's template and markup tokens with scripted output
(benchmarks/scripted_server.py): the same reasoning, text and calls each way; a call cut off goes out as text."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from benchmarks.scripted_server import InProcessServer, make_model
from edgemoe.tools.chat_templates import GLM

from .templates import GLM_TOKENS
from .test_agents_chat import reassemble, whole, without_ids

MODEL = "glm-tools"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
CALL += "<arg_value>3</arg_value>\n</tool_call>"
SCRIPT = f"\n<think>One call.</think>\nChecking.\n{CALL}"


@pytest.fixture(scope="module")
def glm_server(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = InProcessServer(make_model(tmp_path_factory.mktemp("glm") / MODEL, GLM.strip(), GLM_TOKENS))
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)


def test_chat_completions(glm_server):
    client = openai.OpenAI(base_url=f"{glm_server.url}/v1", api_key=glm_server.api_key, max_retries=0, timeout=60)
    for script, max_tokens in ((SCRIPT, 256), (f"Sure.\n{CALL}", 12)):  # the second cut inside its call
        glm_server.script.push(script)
        full = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=max_tokens)
        glm_server.script.push(script)
        chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=max_tokens,
                                                     stream=True))  # fmt: skip
        answer = whole(full.choices[0].message, full.choices[0].finish_reason)
        assert without_ids(reassemble(chunks)) == without_ids(answer)
        if max_tokens == 256:
            assert answer["reasoning"] == "One call." and answer["content"] == "Checking."
            assert [(c["name"], json.loads(c["arguments"])) for c in answer["calls"]] == [
                ("get_weather", {"city": "Paris", "days": 3})
            ]
            assert answer["finish"] == "tool_calls"
        else:
            assert not answer["calls"] and answer["content"].startswith("Sure.\n<tool_call>get_weather")


def test_responses(glm_server):
    client = openai.OpenAI(base_url=f"{glm_server.url}/v1", api_key=glm_server.api_key, max_retries=0, timeout=60)
    tools = [{"type": "function", **TOOLS[0]["function"]}]

    def items(response) -> list:
        out = []
        for item in response.output:
            if item.type == "function_call":
                out.append(("call", item.name, json.loads(item.arguments)))
            elif item.type == "message":
                out.append(("message", "".join(c.text for c in item.content)))
            elif item.type == "reasoning":
                out.append(("reasoning", "".join(c.text for c in item.content or [])))
        return out

    glm_server.script.push(SCRIPT)
    full = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    glm_server.script.push(SCRIPT)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools) as stream:
        final = stream.get_final_response()
    expected = [
        ("reasoning", "One call."),
        ("message", "Checking."),
        ("call", "get_weather", {"city": "Paris", "days": 3}),
    ]
    assert items(full) == items(final) == expected


def test_anthropic_messages(glm_server):
    client = anthropic.Anthropic(base_url=glm_server.url, api_key=glm_server.api_key, max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]

    def blocks(message) -> list:
        return [b.model_dump(include={"type", "text", "thinking", "name", "input"}) for b in message.content]

    glm_server.script.push(SCRIPT)
    m = client.messages.create(model=MODEL, max_tokens=256, messages=USER, tools=tools)
    glm_server.script.push(SCRIPT)
    with client.messages.stream(model=MODEL, max_tokens=256, messages=USER, tools=tools) as stream:
        final = stream.get_final_message()
    expected = [{"type": "thinking", "thinking": "One call."}, {"type": "text", "text": "Checking."},
                {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 3}}]  # fmt: skip
    assert blocks(m) == blocks(final) == expected and m.stop_reason == final.stop_reason == "tool_use"
