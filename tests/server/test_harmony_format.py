"""gpt-oss's harmony format: the parser on its own (every cut of a stream gives the whole answer; what is not a whole
call goes out as written), the template's switches and refusals, a forced call's grammar, and the three chat APIs
(chat completions, Responses, Anthropic Messages) whole and streamed on the demo model dressed in the harmony
template with its markup as special tokens, output scripted (benchmarks/scripted_server.py)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from benchmarks.scripted_server import InProcessServer, make_model
from edgemoe.engine.sequence import RequestOutput
from edgemoe.server.chat_format import detect_formats, parse_all, render_chat
from edgemoe.server.harmony import CALL as CALL_MARK
from edgemoe.server.harmony import MARKS, HarmonyParser, history_closing
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, parse_request
from edgemoe.server.reasoning import Reasoning
from edgemoe.server.replay import TurnStore
from edgemoe.server.tool_calls import Content, ToolCall
from edgemoe.tokenizer import Tokenizer
from edgemoe.tools.chat_templates import HARMONY

from .test_agents_chat import reassemble, whole, without_ids

MODEL = "harmony-tools"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
ANALYSIS = "<|channel|>analysis<|message|>One call, then the answer.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
SCRIPT = ANALYSIS + CALL  # gpt-oss stops on <|call|>, which the output's text then lacks
PARIS = ToolCall(0, "get_weather", '{"city": "Paris"}')
ANSWER = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny, 18 C.<|return|>"


def events(text: str, calls: bool = True, max_calls: int | None = None, cut: int | None = None) -> list:
    """The parser's events for `text`, fed whole or in pieces of `cut` characters, merged by kind."""
    parser, out = HarmonyParser(calls, max_calls), []
    pieces = [text] if cut is None else [text[i : i + cut] for i in range(0, len(text), cut)]
    for e in [e for p in pieces for e in parser.feed(p)] + parser.finish():
        if out and not isinstance(e, ToolCall) and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


CASES = {
    "reasoning, call": (SCRIPT, [Reasoning("One call, then the answer."), PARIS]),
    "reasoning, answer": (ANSWER, [Reasoning("One call, then the answer."), Content("Sunny, 18 C.")]),
    "preamble, call ended": ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL + "<|call|>",
                             [Content("Checking."), PARIS]),
    "call cut off": (ANALYSIS + CALL[:-4], [Reasoning("One call, then the answer."), Content(CALL[:-4])]),
    "not harmony": ("Plain text, <|end of nothing", [Content("Plain text, <|end of nothing")]),
    "another recipient": ("<|channel|>commentary to=browser.search<|message|>{}<|call|>",
                          [Content("<|channel|>commentary to=browser.search<|message|>{}<|call|>")]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_parser_events_at_every_cut(case: str) -> None:
    text, expected = CASES[case]
    for cut in (None, 1, 2, 3, 5, 7, 11):
        assert events(text, cut=cut) == expected, cut


def test_calls_off_or_one_allowed() -> None:
    """Tools off: a call goes out as written; parallel calls off: what follows the first call is dropped."""
    assert events(SCRIPT, calls=False) == [Reasoning("One call, then the answer."), Content(CALL)]
    two = CALL.removeprefix("<|start|>assistant") + "<|call|>" + CALL.replace("Paris", "Rome")
    assert events(two, max_calls=1) == [PARIS]
    assert [c.arguments for c in events(two) if isinstance(c, ToolCall)] == ['{"city": "Paris"}', '{"city": "Rome"}']


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("harmony") / MODEL, HARMONY.strip(), list(MARKS), special=True)


def _render(tok: Tokenizer, body: dict, fields: dict | None = None):
    return render_chat(tok, detect_formats(tok), parse_request(ChatCompletionRequest, body), fields=fields)


def test_template_renders_effort_calls_and_refuses_markup(model) -> None:
    tok = Tokenizer(model)
    assert detect_formats(tok).harmony
    turns = [*USER, {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]  # fmt: skip
    plan = _render(tok, {"messages": turns, "tools": TOOLS, "reasoning_effort": "high"})
    text = tok.decode(plan.prompt_ids, skip_special_tokens=False)
    assert "Reasoning: high" in text and "type get_weather = (_: {" in text
    assert "<|channel|>analysis<|message|>Look it up.<|end|>" in text
    assert CALL.removesuffix('{"city": "Paris"}') + '{"city": "Paris"}<|call|>' in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C<|end|>" in text
    assert text.endswith("<|start|>assistant") and "Reasoning: medium" in tok.decode(_render(tok, {"messages": USER})
                                                                                     .prompt_ids)  # fmt: skip
    with pytest.raises(RequestError) as e:
        _render(tok, {"messages": [{"role": "user", "content": "a<|end|>b"}]})
    assert e.value.param == "messages.0.content" and "<|end|>" in str(e.value)
    with pytest.raises(RequestError) as e:
        _render(tok, {"messages": USER, "reasoning_effort": "extreme"})
    assert e.value.param == "reasoning_effort"


def test_forced_call_grammar_accepts_the_call_only(model) -> None:
    import llguidance

    tok = Tokenizer(model)
    plan = _render(tok, {"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    assert plan.grammar is not None and not llguidance.LLMatcher.validate_grammar(plan.grammar)
    parsed = parse_all(plan.parser(), SCRIPT + "<|call|>")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def server(model):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = InProcessServer(model)
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)


def test_chat_completions(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    for script, tool_choice in ((SCRIPT, "auto"), (ANSWER, "auto"), (SCRIPT, "required")):
        answers = []
        for stream in (False, True):
            server.script.push(script)
            request = dict(messages=USER, tools=TOOLS, tool_choice=tool_choice, reasoning_effort="low")
            out = client.chat.completions.create(model=MODEL, max_tokens=200, stream=stream, **request)
            if stream:
                answers.append(without_ids(reassemble(list(out))))
            else:
                answers.append(without_ids(whole(out.choices[0].message, out.choices[0].finish_reason)))
        assert answers[0] == answers[1]
        assert answers[0]["reasoning"] == "One call, then the answer."
        if script == SCRIPT:
            assert answers[0]["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
            assert answers[0]["content"] == "" and answers[0]["finish"] == "tool_calls"
        else:
            assert answers[0]["content"] == "Sunny, 18 C." and not answers[0]["calls"]


def test_responses(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
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

    server.script.push(SCRIPT)
    full = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, reasoning={"effort": "high"})
    server.script.push(SCRIPT)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools) as stream:
        final = stream.get_final_response()
    expected = [("reasoning", "One call, then the answer."), ("call", "get_weather", {"city": "Paris"})]
    assert items(full) == items(final) == expected
    r = httpx.post(f"{server.url}/v1/responses", headers={"Authorization": f"Bearer {server.api_key}"},
                   json={"model": MODEL, "input": "x", "reasoning": {"effort": "minimal"}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


def test_anthropic_messages(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]

    def blocks(message) -> list:
        return [b.model_dump(include={"type", "text", "thinking", "name", "input"}) for b in message.content]

    server.script.push(SCRIPT)
    m = client.messages.create(model=MODEL, max_tokens=256, messages=USER, tools=tools)
    server.script.push(SCRIPT)
    with client.messages.stream(model=MODEL, max_tokens=256, messages=USER, tools=tools) as stream:
        final = stream.get_final_message()
    expected = [{"type": "thinking", "thinking": "One call, then the answer."},
                {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]  # fmt: skip
    assert blocks(m) == blocks(final) == expected and m.stop_reason == final.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "<|start|>x"}])
    assert e.value.body["type"] == "error" and "<|start|>" in e.value.body["error"]["message"]


@pytest.mark.parametrize("ending", ["call", "answer"])
def test_a_returned_answer_is_replayed_as_generated(model, ending: str) -> None:
    """An answer the server gave, returned parsed (a call's arguments as JSON, its reasoning apart): the next prompt
    starts with the previous prompt and the answer's tokens, then how the turn ends in a history: `<|call|>` after a
    call (where the template ends a returned message's text with `<|end|>`), `<|end|>` after a final answer (which
    stopped on `<|return|>`). Here the model wrote what the template writes, so the replayed prompt is also the
    template's own."""
    tok = Tokenizer(model)
    formats, store = detect_formats(tok), TurnStore()
    first = render_chat(tok, formats, parse_request(ChatCompletionRequest, {"messages": USER, "tools": TOOLS}))
    script, stop = (SCRIPT, CALL_MARK) if ending == "call" else (ANSWER.removesuffix("<|return|>"), "<|return|>")
    answer = tok.encode(script, add_special_tokens=False)
    stop_id = tok.encode(stop, add_special_tokens=False)[0]
    parsed = parse_all(first.parser(), script + stop)
    calls = [(f"call_{k}", c.name, c.arguments) for k, c in enumerate(parsed.calls)]  # ids as a writer gives them
    output = RequestOutput("r", first.prompt_ids, answer + [stop_id], "", "stop", stop_reason=stop_id)
    store.remember(parsed.reasoning, parsed.content, calls, output, first.opening, history_closing(bool(calls)))
    returned = {"role": "assistant", "content": parsed.content or None, "reasoning_content": parsed.reasoning}
    follow = [{"role": "user", "content": "And in Rome?"}]
    if calls:
        returned["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                  for i, n, a in calls]  # fmt: skip
        follow = [{"role": "tool", "tool_call_id": calls[0][0], "content": "18 C"}]
    body = {"messages": [*USER, returned, *follow], "tools": TOOLS}
    second = render_chat(tok, formats, parse_request(ChatCompletionRequest, body), turns=store)
    head = len(first.prompt_ids) + len(answer)
    assert second.prompt_ids[:head] == first.prompt_ids + answer
    rest = tok.decode(second.prompt_ids[head:], skip_special_tokens=False)
    assert rest.startswith(CALL_MARK + "<|start|>functions.get_weather" if calls else "<|end|><|start|>user")
    if calls:  # without the store the template writes the same text (it keeps a call turn's analysis)
        plain = render_chat(tok, formats, parse_request(ChatCompletionRequest, body))
        assert tok.decode(second.prompt_ids, skip_special_tokens=False) == tok.decode(
            plain.prompt_ids, skip_special_tokens=False
        )
