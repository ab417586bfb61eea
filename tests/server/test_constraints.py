"""Forced tool calls and structured outputs by grammar (`server/constraints.py`, applied by `engine/grammar.py`):
each format's grammar takes a valid call (which its output parser reads back) and refuses what is not one; and through
each API's SDK the demo model, which writes plays, answers a forced call with a valid call and a required format
with JSON that fits the schema."""

from __future__ import annotations

import json

import anthropic
import llguidance
import openai
import pytest

from benchmarks.scripted_server import QWEN3_TEMPLATE, QWEN_TOKENS, make_model
from edgemoe import SamplingParams
from edgemoe.server.chat_format import ChatPlan, OutputParser, detect_formats, parse_all
from edgemoe.server.constraints import grammar, response_schema
from edgemoe.server.protocol import RequestError
from edgemoe.server.tool_calls import TOOL_PARSERS
from edgemoe.tokenizer import Tokenizer
from edgemoe.tools.chat_templates import GLM

from .templates import CODER_TEMPLATE, GLM_TOKENS, MISTRAL_TEMPLATE, MISTRAL_TOKENS

MODEL = "qwen-tools"
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
DAYS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["days"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "forecast", "parameters": DAYS}}]  # fmt: skip
CALLS = {  # a valid call of get_weather in each format
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
                   "</tool_call>",
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("constraints")
    return {
        "qwen": Tokenizer(make_model(root / "qwen", QWEN3_TEMPLATE, QWEN_TOKENS)),
        "qwen3_coder": Tokenizer(make_model(root / "coder", CODER_TEMPLATE, ["<tool_call>", "</tool_call>"])),
        "mistral": Tokenizer(make_model(root / "mistral", MISTRAL_TEMPLATE, MISTRAL_TOKENS, special=True)),
        "glm": Tokenizer(make_model(root / "glm", GLM.strip(), GLM_TOKENS)),
        # Mistral's v11 tokenizers (Mistral-Small-3.2, Devstral, Magistral) have an [ARGS] token: NAME[ARGS]{...} calls
        "mistral_v11": Tokenizer(make_model(root / "v11", MISTRAL_TEMPLATE, [*MISTRAL_TOKENS, "[ARGS]"], special=True)),
    }


def accepts(tok: Tokenizer, text_grammar: str, text: str) -> bool:
    """Does the grammar take `text` (as the tokenizer cuts it) whole, ending there?"""
    eos = tok.encode("<|im_end|>", add_special_tokens=False)
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tok.to_json(), eos_token=eos), text_grammar, log_level=0)
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", list(CALLS))
def test_each_format_takes_a_call_and_refuses_the_rest(tokenizers, fmt):
    tok = tokenizers[fmt]
    formats = detect_formats(tok)
    assert formats.tool_parser == fmt
    required = grammar(tok, formats, TOOLS, "required", None, True, False)
    named = grammar(tok, formats, TOOLS, "forecast", None, True, False)
    assert accepts(tok, required, CALLS[fmt]) and not accepts(tok, named, CALLS[fmt])
    assert not accepts(tok, required, "It is sunny.") and not accepts(tok, required, CALLS[fmt][:-3])
    parsed = parse_all(OutputParser(None, TOOL_PARSERS[fmt](TOOLS)), CALLS[fmt])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Rome"})]
    if fmt == "qwen":  # two calls where parallel calls are allowed, one where not; reasoning before them
        two = f"{CALLS[fmt]}\n{CALLS[fmt]}"
        assert accepts(tok, required, two) and not accepts(tok, grammar(tok, formats, TOOLS, "required", None,
                                                                        False, False), two)  # fmt: skip
        assert accepts(tok, required, f"<think>\nRome, then.\n</think>\n\n{CALLS[fmt]}")


def test_mistral_v11_calls_name_then_args(tokenizers):
    """v11: one `[TOOL_CALLS]NAME[ARGS]{...}` per call, no JSON list; the grammar takes exactly that, and the parser
    reads back what it took."""
    tok = tokenizers["mistral_v11"]
    formats = detect_formats(tok)
    assert formats.tool_parser == "mistral" and formats.mistral_v11
    assert not detect_formats(tokenizers["mistral"]).mistral_v11
    one = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    two = f'{one}[TOOL_CALLS]forecast[ARGS]{{"days": 3}}'
    required = grammar(tok, formats, TOOLS, "required", None, True, False)
    single = grammar(tok, formats, TOOLS, "required", None, False, False)
    named = grammar(tok, formats, TOOLS, "forecast", None, True, False)
    assert accepts(tok, required, one) and accepts(tok, required, two)
    assert accepts(tok, single, one) and not accepts(tok, single, two)
    assert not accepts(tok, named, one) and accepts(tok, named, '[TOOL_CALLS]forecast[ARGS]{"days": 3}')
    for bad in (CALLS["mistral"], '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "[TOOL_CALLS]get_weather{}",
                '[TOOL_CALLS]forecast[ARGS]{"days": 0}', one[:-2]):  # fmt: skip
        assert not accepts(tok, required, bad), bad
    parsed = parse_all(OutputParser(None, TOOL_PARSERS["mistral"](TOOLS)), two)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("forecast", {"days": 3}),
    ]


def test_json_and_either(tokenizers):
    tok = tokenizers["qwen"]
    formats = detect_formats(tok)
    schema = grammar(tok, formats, [], None, DAYS, True, False)
    assert accepts(tok, schema, '{"days": 3}') and accepts(tok, schema, '<think>\nThree.\n</think>\n\n{"days": 3}')
    for bad in ('{"days": 12}', '{"days": "3"}', '{"days": 3, "x": 1}', "{'days': 3}", "Three days."):
        assert not accepts(tok, schema, bad), bad
    opened = grammar(tok, formats, [], None, DAYS, True, True)  # the prompt opened <think>: the answer closes it
    assert accepts(tok, opened, 'Three.\n</think>\n\n{"days": 3}') and not accepts(tok, opened, '{"days": 3}')
    either = grammar(tok, formats, TOOLS, "auto", DAYS, True, False)
    assert accepts(tok, either, '{"days": 3}') and accepts(tok, either, CALLS["qwen"])
    assert not accepts(tok, either, "It is sunny.")
    assert grammar(tok, formats, TOOLS, None, None, True, False) is None
    plan = ChatPlan([1], formats, TOOLS, "required", grammar=schema)
    assert plan.sampling([SamplingParams()])[0].grammar == schema
    any_object = grammar(tok, formats, [], None, response_schema({"type": "json_object"}, "f"), True, False)
    assert accepts(tok, any_object, '{"a": [1, 2]}') and not accepts(tok, any_object, "[1]")
    assert response_schema(None, "f") is None and response_schema({"type": "text"}, "f") is None
    with pytest.raises(RequestError):
        response_schema({"type": "json_schema"}, "f")


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=120)


def test_forced_calls_through_the_apis(tool_server, client):
    """No script: the demo model, left to itself, writes a valid call of the required tool."""
    user = [{"role": "user", "content": "Weather in Rome?"}]
    kw = dict(model=MODEL, messages=user, tools=TOOLS, temperature=0, max_tokens=200)
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "forecast"}}, **kw)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "forecast" and 1 <= json.loads(call.function.arguments)["days"] <= 9
    required = client.chat.completions.create(tool_choice="required", **kw).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    response = client.responses.create(model=MODEL, input="Weather?", tools=flat, tool_choice="required",
                                       temperature=0, max_output_tokens=200)  # fmt: skip
    assert [i.type for i in response.output if i.type != "reasoning"][0] == "function_call"
    claude = anthropic.Anthropic(base_url=tool_server.url, api_key=tool_server.api_key, max_retries=0, timeout=120)
    message = claude.messages.create(model=MODEL, max_tokens=200, extra_body={"temperature": 0}, messages=user,
                                     tools=[{"name": "get_weather", "input_schema": CITY}],
                                     tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome") and message.stop_reason == "tool_use"


def test_structured_outputs_through_the_apis(tool_server, client):
    """No script: the answer is JSON that fits the schema, whatever the model would have written."""
    user = [{"role": "user", "content": "How many days?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "days", "schema": DAYS, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=user, response_format=fmt, temperature=0)
    assert 1 <= json.loads(chat.choices[0].message.content)["days"] <= 9
    text = {"format": {"type": "json_schema", "name": "days", "schema": DAYS, "strict": True}}
    response = client.responses.create(model=MODEL, input="How many days?", text=text, temperature=0)
    assert 1 <= json.loads(response.output_text)["days"] <= 9 and response.text.format.type == "json_schema"
    claude = anthropic.Anthropic(base_url=tool_server.url, api_key=tool_server.api_key, max_retries=0, timeout=120)
    message = claude.messages.create(model=MODEL, max_tokens=200, extra_body={"temperature": 0}, messages=user,
                                     output_config={"format": {"type": "json_schema", "schema": DAYS}})  # fmt: skip
    assert 1 <= json.loads(message.content[-1].text)["days"] <= 9
