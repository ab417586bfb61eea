"""The Anthropic Messages API through the official `anthropic` client on scripted outputs: text, thinking and
tool_use blocks whole and streamed (the event sequence checked raw), tool results, stop sequences, max_tokens,
count_tokens, both API-key headers, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

MODEL = "qwen-tools"
TOOLS = [{"name": "get_weather", "description": "Current weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT_CALL = f"<think>\nA call.\n</think>\n\nChecking.\n{CALL}"


@pytest.fixture(scope="module")
def client(tool_server):
    return anthropic.Anthropic(base_url=tool_server.url, api_key=tool_server.api_key, max_retries=0, timeout=60)


def blocks(message) -> list[dict]:
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if b.type == "tool_use":
            assert d.pop("id").startswith("toolu_")
        out.append(d)
    return out


def test_text_and_usage(tool_server, client):
    tool_server.script.push("Sunny, 18 C.")
    m = client.messages.create(model=MODEL, max_tokens=64, messages=USER, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert blocks(m) == [{"type": "text", "text": "Sunny, 18 C."}] and m.stop_reason == "end_turn"
    assert m.usage.output_tokens == len(tool_server.script.tokenizer.encode("Sunny, 18 C.")) + 1  # + the end token
    count = client.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens  # input_tokens: the uncached


def test_thinking_text_and_tool_use_whole_and_streamed(tool_server, client):
    tool_server.script.push(THINK_TEXT_CALL)
    m = client.messages.create(model=MODEL, max_tokens=256, messages=USER, tools=TOOLS)
    expected = [{"type": "thinking", "thinking": "A call.", "signature": "edgemoe"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]  # fmt: skip
    assert blocks(m) == expected and m.stop_reason == "tool_use"
    tool_server.script.push(THINK_TEXT_CALL)
    with client.messages.stream(model=MODEL, max_tokens=256, messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert blocks(final) == expected and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == m.usage.output_tokens
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens  # the second request reads the first's prefix
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt


def test_raw_event_sequence(tool_server):
    tool_server.script.push(THINK_TEXT_CALL)
    body = {"model": MODEL, "max_tokens": 256, "messages": USER, "tools": TOOLS, "stream": True}
    with httpx.stream("POST", f"{tool_server.url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": tool_server.api_key}) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.startswith(": keep-alive\n\n")  # a comment at once: message_start waits for the prefill
    events = []
    for frame in raw.strip().split("\n\n"):
        if frame.startswith(":"):  # comments: SSE clients skip them
            continue
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    opened = []
    for e in events[1:-2]:  # blocks open, take deltas and close in order, one at a time
        if e["type"] == "content_block_start":
            assert e["index"] == len(opened) and (not opened or opened[-1] is None)
            opened.append(e["content_block"]["type"])
        elif e["type"] == "content_block_delta":
            assert e["index"] == len(opened) - 1 and opened[-1] is not None
        else:
            assert e["type"] == "content_block_stop" and e["index"] == len(opened) - 1
            opened[-1] = None
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] and opened[-1] is None
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    json_deltas = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert json.loads("".join(json_deltas)) == {"city": "Paris"}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_tool_result_turn_and_prefill(tool_server, client):
    tool_server.script.push(CALL)
    first = client.messages.create(model=MODEL, max_tokens=256, messages=USER, tools=TOOLS)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    turns = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"},
                                          {"type": "text", "text": "And tomorrow?"}]}]  # fmt: skip
    tool_server.script.push("Same.")
    second = client.messages.create(model=MODEL, max_tokens=64, messages=turns, tools=TOOLS)
    assert blocks(second) == [{"type": "text", "text": "Same."}]
    tool_server.script.push(" 42.")  # a last assistant message is continued, not repeated
    prefilled = client.messages.create(model=MODEL, max_tokens=64,
                                       messages=[*USER, {"role": "assistant", "content": "The answer is"}])  # fmt: skip
    assert blocks(prefilled) == [{"type": "text", "text": " 42."}]


def test_stop_sequences_max_tokens_and_thinking_switch(tool_server, client):
    tool_server.script.push("one two three")
    m = client.messages.create(model=MODEL, max_tokens=64, messages=USER, stop_sequences=["three", "two"])
    assert (m.stop_reason, m.stop_sequence, blocks(m)) == ("stop_sequence", "two", [{"type": "text", "text": "one "}])
    tool_server.script.push("a long answer that goes on")
    m = client.messages.create(model=MODEL, max_tokens=3, messages=USER)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    tool_server.script.push("x")  # an agent's max_tokens far beyond the context is capped, not refused
    assert client.messages.create(model=MODEL, max_tokens=32000, messages=USER).stop_reason == "end_turn"
    on = client.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    off = client.messages.count_tokens(model=MODEL, messages=USER, thinking={"type": "disabled"}).input_tokens
    assert off > on  # enable_thinking false: the template wrote an empty <think> block


def test_both_key_headers(tool_server):
    bearer = anthropic.Anthropic(base_url=tool_server.url, auth_token=tool_server.api_key, max_retries=0)
    tool_server.script.push("ok")
    assert bearer.messages.create(model=MODEL, max_tokens=8, messages=USER).content[0].text == "ok"
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=tool_server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=USER)  # fmt: skip
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"


ASSISTANT_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]}  # fmt: skip
BAD = [  # (id, body, status, error type)
    ("no-max-tokens", {"messages": USER, "max_tokens": None}, 400, "invalid_request_error"),
    ("unknown-block", {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
     "invalid_request_error"),
    ("image-block", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ("tool-result-unknown-id", {"messages": [*USER, ASSISTANT_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]}, 400, "invalid_request_error"),
    ("tool-input-not-object", {"messages": [*USER, {**ASSISTANT_USE, "content": [{**ASSISTANT_USE["content"][0],
                                                                                  "input": "Paris"}]}]},
     400, "invalid_request_error"),
    ("tool-without-name", {"messages": USER, "tools": [{"input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error"),
    ("server-tool", {"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error"),
    ("bad-role", {"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ("format-without-schema", {"messages": USER, "output_config": {"format": {"type": "json_schema"}}},
     400, "invalid_request_error"),
    ("unknown-model", {"model": "claude-opus-4", "messages": USER}, 404, "not_found_error"),
]  # fmt: skip


@pytest.mark.parametrize("body,status,kind", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_errors_in_anthropic_shape(tool_server, body, status, kind):
    body = {k: v for k, v in {"model": MODEL, "max_tokens": 16, **body}.items() if v is not None}
    r = httpx.post(f"{tool_server.url}/v1/messages", json=body, headers={"x-api-key": tool_server.api_key}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"} and err["error"]["type"] == kind
    assert err["error"]["message"]


def test_lone_surrogate(tool_server):
    body = b'{"model":"qwen-tools","max_tokens":8,"messages":[{"role":"user","content":"a\\ud800"}]}'
    r = httpx.post(f"{tool_server.url}/v1/messages", content=body, timeout=30,
                   headers={"x-api-key": tool_server.api_key, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{tool_server.url}/v1/tokenize", content=b'{"prompt":"a\\ud800"}', timeout=30,
                   headers={"x-api-key": tool_server.api_key, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
