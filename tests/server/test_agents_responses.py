"""The OpenAI Responses API through the official `openai` client on scripted outputs (output items whole and
streamed, function-call round trips, incomplete answers, refusals of what a stateless server cannot do), and
/v1/tokenize, /v1/detokenize."""

from __future__ import annotations

import httpx
import openai
import pytest

from .test_server import assert_error

MODEL = "qwen-tools"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = f"<think>\nOne call.\n</think>\n\nChecking.\n{CALL}\n{CALL.replace('Paris', 'Rome')}"


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)


def items(response) -> list[dict]:
    out = []
    for item in response.output:
        d = item.model_dump(exclude_none=True)
        d.pop("id")
        if d["type"] == "function_call":
            assert d.pop("call_id").startswith("call_")
        out.append(d)
    return out


EXPECTED = [
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "One call."}]},
    {"type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
    {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
    {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Rome"}', "status": "completed"},
]  # fmt: skip


def test_text(tool_server, client):
    tool_server.script.push("Hello there.")
    r = client.responses.create(model=MODEL, input="hi", instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.output_text == "Hello there."
    assert r.usage.output_tokens >= 1 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_items_whole_and_streamed(tool_server, client):
    tool_server.script.push(SCRIPT)
    whole = client.responses.create(model=MODEL, input="Weather in Paris and Rome?", tools=TOOLS)
    assert items(whole) == EXPECTED and whole.status == "completed"
    tool_server.script.push(SCRIPT)
    with client.responses.stream(model=MODEL, input="Weather in Paris and Rome?", tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert items(final) == EXPECTED
    cached = {"input_tokens_details"}  # the second request reads the first's prefix from the cache
    assert final.usage.model_dump(exclude=cached) == whole.usage.model_dump(exclude=cached)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    args = ["".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                    and e.output_index == i) for i in (2, 3)]  # fmt: skip
    assert (reasoning, text, args) == ("One call.", "Checking.", ['{"city": "Paris"}', '{"city": "Rome"}'])


def test_function_call_round_trip_and_incomplete(tool_server, client):
    tool_server.script.push(CALL)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, parallel_tool_calls=False)
    (call,) = [i for i in first.output if i.type == "function_call"]
    turn = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]  # fmt: skip
    tool_server.script.push("18 C in Paris.")
    second = client.responses.create(model=MODEL, input=turn, tools=TOOLS)
    assert second.output_text == "18 C in Paris."
    tool_server.script.push("a long answer that goes on and on")
    cut = client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    tool_server.script.push(CALL.replace("Paris", "Oslo"))  # a named function: the grammar lets the call through
    named = client.responses.create(model=MODEL, input="hi", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert [(i.name, i.arguments) for i in named.output] == [("get_weather", '{"city": "Oslo"}')]


BAD = [  # (id, body, param)
    ("previous-response", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("untyped-tool", {"input": "hi", "tools": [{"name": "f"}]}, "tools.0.type"),
    ("image-input", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ("unknown-call-id", {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "input.0.call_id"),
    ("arguments-not-object", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
     "input.0.arguments"),
    ("format-without-schema", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ("no-input", {}, "input"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests(tool_server, body, param):
    r = httpx.post(f"{tool_server.url}/v1/responses", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {tool_server.api_key}"})  # fmt: skip
    assert_error(r, 400, param)


def test_tokenize_detokenize(tool_server, client):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{tool_server.url}/v1/{path}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {tool_server.api_key}"})  # fmt: skip

    tok = tool_server.script.tokenizer
    r = post("tokenize", {"prompt": "To be, or not <tool_call>", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("To be, or not <tool_call>") and r["count"] == len(r["tokens"])
    assert r["token_strs"][-1] == "<tool_call>" and r["max_model_len"] == 2048
    assert post("detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "To be, or not <tool_call>"}
    messages = [{"role": "user", "content": "hi"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    tool_server.script.push("x")
    usage = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools).usage
    assert post("tokenize", {"messages": messages, "tools": chat_tools}).json()["count"] == usage.prompt_tokens
    bare = post("tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert not tok.decode(bare["tokens"], skip_special_tokens=False).endswith("assistant\n")
    assert_error(post("tokenize", {"prompt": "a", "messages": messages}), 400, "prompt")
    assert_error(post("tokenize", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}), 400,
                 "messages.0.tool_call_id")  # fmt: skip
    assert_error(post("detokenize", {"tokens": [1, 10**6]}), 400, "tokens")
    assert_error(post("detokenize", {"tokens": "abc"}), 400, "tokens")
