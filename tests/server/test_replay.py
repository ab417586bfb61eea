"""Answers replayed as generated: an agent sends each answer back parsed (calls as JSON objects, reasoning apart), and
the template would re-render them its own way; the server renders them with the tokens the model generated, so each
turn's prompt starts with the previous turn's prompt and answer, and the prefix cache serves it. Through each API's
SDK, on a template that re-renders a call's JSON with other spacing and drops reasoning before the last user turn."""

from __future__ import annotations

import json
from array import array

import anthropic
import openai
import pytest

from benchmarks.scripted_server import PromptLog
from edgemoe.engine.sequence import RequestOutput
from edgemoe.server.replay import TurnStore

MODEL = "qwen-tools"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
# compact JSON: the template writes `{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}`
CALL = '<think>\nOne call.\n</think>\n\nChecking.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris",' \
       '"days":2}}\n</tool_call>'  # fmt: skip
ANSWER = "18 C in Paris."
QUESTION, AGAIN = "Weather in Paris?", "And tomorrow?"


@pytest.fixture(scope="module")
def log(tool_server):
    log = PromptLog()
    tool_server.engine_loop.engine.logits_processors.append(log)
    yield log
    tool_server.engine_loop.engine.logits_processors.remove(log)


def check(tool_server, log: PromptLog, scripts: list[str], cached: list[int]) -> None:
    """Each of the last turns' prompts starts with the turn before's prompt and answer (its tokens and the end of
    the turn), and the prefix cache served that much of it (in whole blocks; the sampled end token was never run)."""
    tok, block = tool_server.script.tokenizer, tool_server.engine_loop.engine.kv.block_size
    prompts = log.last(len(scripts) + 1)
    for before, script, prompt, hit in zip(prompts, scripts, prompts[1:], cached):
        answer = tok.encode(script, add_special_tokens=False) + [tool_server.script.end]
        assert prompt[: len(before) + len(answer)] == before + answer
        assert hit >= (len(before) + len(answer) - 1) // block * block  # (the end token's K/V is never computed)


def system(api: str) -> str:
    return f"Replay test through {api}: you report the weather."  # a prompt no other test has cached


def test_openai_chat(tool_server, log):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": system("chat")}, {"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER, ANSWER)
    one = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    call = one.choices[0].message
    assert call.reasoning_content == "One call."
    assert call.tool_calls[0].function.arguments == '{"city": "Paris", "days": 2}'
    messages += [call.model_dump(exclude_none=True, exclude={"reasoning_content"}),  # a client that drops it
                 {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C"}]  # fmt: skip
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=tools,
                                        stream_options={"include_usage": True}) as s:  # fmt: skip
        two = s.get_final_completion()
    messages += [two.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": AGAIN}]
    three = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    assert three.choices[0].message.content == ANSWER
    check(tool_server, log, [CALL, ANSWER], [r.usage.prompt_tokens_details.cached_tokens for r in (two, three)])


def test_a_sampled_cut_replays_as_sampled(tool_server, log):
    """A model may sample a text in tokens its tokenizer would not choose ("Checking" letter by letter here); the next
    turn's prompt holds those tokens, not the text tokenized again, so the prefix cache still serves the answer."""
    tok = tool_server.script.tokenizer
    head, word, tail = CALL.partition("Checking")
    cut = [head, *word, tail]  # the word a letter a token
    ids = [i for piece in cut for i in tok.encode(piece, add_special_tokens=False)]
    assert tok.decode(ids, skip_special_tokens=False) == CALL and ids != tok.encode(CALL, add_special_tokens=False)
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": system("a sampled cut")}, {"role": "user", "content": QUESTION}]
    tool_server.script.push(ids, ANSWER)
    one = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    call = one.choices[0].message
    messages += [call.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C"}]  # fmt: skip
    two = client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    before, prompt = log.last(2)
    assert prompt[: len(before) + len(ids) + 1] == before + ids + [tool_server.script.end]
    block = tool_server.engine_loop.engine.kv.block_size
    assert two.usage.prompt_tokens_details.cached_tokens >= (len(before) + len(ids)) // block * block


def test_anthropic(tool_server, log):
    client = anthropic.Anthropic(base_url=tool_server.url, api_key=tool_server.api_key, max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=256, system=system("anthropic"),
              tools=[{"name": "get_weather", "input_schema": SCHEMA}])  # fmt: skip
    messages = [{"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER, ANSWER)
    with client.messages.stream(messages=messages, **kw) as s:
        one = s.get_final_message()
    (use,) = [b for b in one.content if b.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in one.content]},
                 {"role": "user", "content": [result]}]  # fmt: skip
    two = client.messages.create(messages=messages, **kw)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in two.content]},
                 {"role": "user", "content": AGAIN}]  # fmt: skip
    three = client.messages.create(messages=messages, **kw)
    assert three.content[0].text == ANSWER
    check(tool_server, log, [CALL, ANSWER], [m.usage.cache_read_input_tokens for m in (two, three)])
    count = client.messages.count_tokens(model=MODEL, system=kw["system"], tools=kw["tools"], messages=messages)
    assert count.input_tokens == len(log.last(1)[0])  # counted as the messages route renders it: replayed


def test_responses(tool_server, log):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    kw = dict(model=MODEL, instructions=system("responses"),
              tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}])  # fmt: skip
    items: list[dict] = [{"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER, ANSWER)
    one = client.responses.create(input=items, **kw)
    (call,) = [i for i in one.output if i.type == "function_call"]
    items += [i.model_dump(exclude_none=True) for i in one.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C"})
    with client.responses.stream(input=items, **kw) as s:
        two = s.get_final_response()
    items += [i.model_dump(exclude_none=True) for i in two.output] + [{"role": "user", "content": AGAIN}]
    three = client.responses.create(input=items, **kw)
    assert three.output_text == ANSWER
    check(tool_server, log, [CALL, ANSWER], [r.usage.input_tokens_details.cached_tokens for r in (two, three)])


def test_thinking_off(tool_server, log):
    """The generation prompt then holds an empty think block, which the template does not write for a past turn:
    the answer's opening brings it back."""
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": system("thinking off")}, {"role": "user", "content": QUESTION}]
    script = CALL.split("\n\n", 1)[1]
    kw = dict(model=MODEL, tools=tools, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    tool_server.script.push(script, ANSWER)
    call = client.chat.completions.create(messages=messages, **kw).choices[0].message
    messages += [call.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C"}]  # fmt: skip
    two = client.chat.completions.create(messages=messages, **kw)
    check(tool_server, log, [script], [two.usage.prompt_tokens_details.cached_tokens])
    assert "<think>\n\n</think>\n\nChecking." in tool_server.script.tokenizer.decode(log.last(1)[0], False)


def test_an_edited_call_is_rendered_by_the_template(tool_server, log):
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    messages = [{"role": "system", "content": system("edits")}, {"role": "user", "content": QUESTION}]
    tool_server.script.push(CALL, ANSWER)
    message = client.chat.completions.create(model=MODEL, messages=messages, tools=tools).choices[0].message
    edited = message.model_dump(exclude_none=True)
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Rome", "days": 2})
    messages += [edited, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "20 C"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
    text = tool_server.script.tokenizer.decode(log.last(1)[0], skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}' in text


def output(ids: list[int], finish: str = "stop", stop: str | int | None = None) -> RequestOutput:
    return RequestOutput("r", [1], ids, "", finish, stop_reason=stop)


def test_store_bounds_and_what_it_keeps():
    message = {"role": "assistant", "content": "Hi.", "reasoning_content": "Think."}
    store = TurnStore(max_tokens=6, max_age_s=3600)
    store.remember("Think.", "Hi. ", [], output([5, 6, 7, 0]), "<a>")
    turn = store.find(message)
    assert turn.opening == "<a>" and turn.ids == array("i", [5, 6, 7])  # the stop token left out
    assert store.find({**message, "content": "Hi!"}) is None
    assert store.find({**message, "reasoning_content": ""}) is None
    call = [("call_1", "f", '{"a": 1}')]
    store.remember("", "", call, output([8, 9, 0]), "<a>")  # 3 + 2 keys x 2 tokens > 6: the oldest goes
    assert store.find(message) is None and len(store) == 2
    sent = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": {"a": 1}}}],
    }
    assert store.find(sent).ids == array("i", [8, 9])  # reasoning left out by the client: found by its call id
    for cut in (output([1, 2], "length"), output([1, 2], "stop", "STOP"), output([1, 2], "abort")):
        store = TurnStore()
        store.remember("", "x", [], cut, "")
        assert len(store) == 0
    old = TurnStore(max_age_s=-1)
    old.remember("", "x", [], output([1, 0]), "")
    assert old.find({"role": "assistant", "content": "x"}) is None
