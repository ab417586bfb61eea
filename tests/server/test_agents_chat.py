"""Chat completions with tools and reasoning, through the real HTTP path with the official `openai` client, on a
server whose output is scripted (benchmarks/scripted_server.py): calls parsed whole and streamed, the stream's deltas
reassembling to the non-streamed answer, tool_choice, multi-turn tool conversations, and 4xx for bad ones."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .test_server import assert_error

MODEL = "qwen-tools"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object",
     "properties": {"path": {"type": "string"}}}}},
]  # fmt: skip
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def qcall(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


PARIS, ROME = qcall("get_weather", {"city": "Paris"}), qcall("get_weather", {"city": "Rome"})
SCRIPTS = {  # id -> (script, max_tokens: None, or the tokens of this text plus 5)
    "reasoning-text-two-calls": (f"<think>\nTwo cities: two calls.\n</think>\n\nLet me look.\n{PARIS}\n{ROME}", None),
    "unicode-and-escapes": (qcall("read_file", {"path": 'C:\\tmp\\"日本".txt'}), None),
    "plain-answer": ("<think>\nEasy.\n</think>\n\nIt is sunny.", None),
    "malformed-call": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', None),
    "cut-by-max-tokens": (f"{PARIS}\n{ROME}", f"{PARIS}\n"),  # the first call whole, the second cut: as text
}


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)


def reassemble(chunks: list) -> dict:
    """A streamed choice -> the fields of a non-streamed message; checks the tool-call delta protocol on the way."""
    reasoning, content, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        (choice,) = c.choices
        assert finish is None  # nothing after the finish chunk
        delta, finish = choice.delta, choice.finish_reason
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for t in delta.tool_calls or []:
            if t.index not in calls:  # a new call: its id, type and name come first, arguments after
                assert t.index == len(calls) and t.id and t.type == "function" and t.function.name
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""}
            else:
                assert t.id is None and not t.function.name
                calls[t.index]["arguments"] += t.function.arguments
    return {"reasoning": reasoning, "content": content, "calls": list(calls.values()), "finish": finish}


def whole(message, finish: str) -> dict:
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls or []]
    reasoning = getattr(message, "reasoning_content", None) or ""
    return {"reasoning": reasoning, "content": message.content or "", "calls": calls, "finish": finish}


def without_ids(answer: dict) -> dict:
    return {**answer, "calls": [{k: v for k, v in c.items() if k != "id"} for c in answer["calls"]]}


def limit(tool_server, upto: str | None) -> int:
    return 256 if upto is None else len(tool_server.script.tokenizer.encode(upto, add_special_tokens=False)) + 5


@pytest.mark.parametrize("script,upto", list(SCRIPTS.values()), ids=list(SCRIPTS))
def test_stream_reassembles_to_the_whole_answer(tool_server, client, script, upto):
    max_tokens = limit(tool_server, upto)
    tool_server.script.push(script)
    full = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=max_tokens)
    tool_server.script.push(script)
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=max_tokens,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    streamed, answer = reassemble(chunks), whole(full.choices[0].message, full.choices[0].finish_reason)
    assert without_ids(streamed) == without_ids(answer)
    for call in answer["calls"]:
        assert isinstance(json.loads(call["arguments"]), dict) and call["id"].startswith("call_")
    assert len({c["id"] for c in answer["calls"] + streamed["calls"]}) == 2 * len(answer["calls"])


def test_what_each_script_gives(tool_server, client):
    def ask(script: str, **kw) -> dict:
        tool_server.script.push(script)
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, **kw)
        return without_ids(whole(r.choices[0].message, r.choices[0].finish_reason))

    paris = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    rome = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    script, _ = SCRIPTS["reasoning-text-two-calls"]
    assert ask(script) == {"reasoning": "Two cities: two calls.", "content": "Let me look.", "calls": [paris, rome],
                           "finish": "tool_calls"}  # fmt: skip
    assert ask(script, parallel_tool_calls=False)["calls"] == [paris]
    assert ask(SCRIPTS["plain-answer"][0]) == {"reasoning": "Easy.", "content": "It is sunny.", "calls": [],
                                               "finish": "stop"}  # fmt: skip
    malformed = SCRIPTS["malformed-call"][0]
    assert ask(malformed) == {"reasoning": "", "content": malformed, "calls": [], "finish": "stop"}
    script, upto = SCRIPTS["cut-by-max-tokens"]
    cut = ask(script, max_tokens=limit(tool_server, upto))
    assert cut["calls"] == [paris] and cut["content"].startswith("<tool_call>") and cut["finish"] == "length"
    # tool_choice: a grammar requires the call (tests/server/test_constraints.py); a script that is one passes
    oslo = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert ask(oslo, tool_choice={"type": "function", "function": {"name": "get_weather"}})["calls"] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]  # fmt: skip
    read = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    assert ask(read, tool_choice="required")["calls"] == [{"name": "read_file", "arguments": '{"path": "a"}'}]
    assert ask(PARIS, tool_choice="none") == {"reasoning": "", "content": PARIS, "calls": [], "finish": "stop"}
    # a stop string still ends the output (before it is parsed)
    assert ask(f"Look.\n{PARIS}", stop=["Look"]) == {"reasoning": "", "content": "", "calls": [], "finish": "stop"}


def test_sdk_stream_helper_and_n_choices(tool_server, client):
    script = SCRIPTS["reasoning-text-two-calls"][0]
    tool_server.script.push(script)
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]  # fmt: skip
    assert final.choices[0].finish_reason == "tool_calls"
    tool_server.script.push(PARIS, "Just text.")
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, n=2, stream=True))
    by_choice = [reassemble([c for c in chunks if c.choices and c.choices[0].index == i]) for i in (0, 1)]
    assert sorted(len(a["calls"]) for a in by_choice) == [0, 1]  # each choice has its own parser


def test_multi_turn_tool_conversation(tool_server, client):
    tool_server.script.push(SCRIPTS["reasoning-text-two-calls"][0])
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS).choices[0].message
    turns = [*USER, first.model_dump(exclude_none=True)]
    turns += [{"role": "tool", "tool_call_id": c.id, "content": f"{i + 18} C"} for i, c in enumerate(first.tool_calls)]
    tool_server.script.push("Paris 18 C, Rome 19 C.")
    second = client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS)
    assert second.choices[0].message.content == "Paris 18 C, Rome 19 C." and second.choices[0].finish_reason == "stop"
    auth = {"Authorization": f"Bearer {tool_server.api_key}"}
    prompt = httpx.post(f"{tool_server.url}/v1/tokenize", headers=auth, timeout=30,
                        json={"model": MODEL, "messages": turns, "tools": TOOLS}).json()  # fmt: skip
    assert prompt["count"] == second.usage.prompt_tokens  # /v1/tokenize renders exactly as the chat does
    text = httpx.post(f"{tool_server.url}/v1/detokenize", headers=auth, json={"tokens": prompt["tokens"]}).json()
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n19 C\n</tool_response>" in text["prompt"]
    assert "<think>\nTwo cities: two calls.\n</think>" in text["prompt"]  # the reasoning went back to the template


def test_thinking_switch(tool_server, client):
    tool_server.script.push("No thinking here.")
    r = client.chat.completions.create(model=MODEL, messages=USER, extra_body={"chat_template_kwargs":
                                       {"enable_thinking": False}})  # fmt: skip
    assert r.choices[0].message.content == "No thinking here."
    tool_server.script.push("x")
    on = client.chat.completions.create(model=MODEL, messages=USER)
    assert r.usage.prompt_tokens > on.usage.prompt_tokens  # the template wrote an empty <think> block


BAD = [  # (id, body, param)
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("arguments-not-object", {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
     "function": {"name": "get_weather", "arguments": '"Paris"'}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ("unknown-tool-call-id", {"messages": [*USER, {"role": "tool", "tool_call_id": "nope", "content": "x"}]},
     "messages.1.tool_call_id"),
    ("tool-choice-unknown", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
     "tool_choice"),
    ("tools-not-a-list", {"tools": {"type": "function"}}, "tools"),
    ("parallel-not-bool", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tool_requests(tool_server, body, param):
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", json={"messages": USER, **body}, timeout=30,
                   headers={"Authorization": f"Bearer {tool_server.api_key}"})  # fmt: skip
    assert_error(r, 400, param)


def test_api_key(tool_server):
    bad = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=USER)
    assert_error(httpx.post(f"{tool_server.url}/v1/responses", json={"input": "hi"}), 401)
