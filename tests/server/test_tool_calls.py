"""The output parsers (tool calls of each format, reasoning) on scripted outputs: each gives the expected split, and
the same split whatever chunks the text arrives in (every cut point, one character at a time, random cuts), so a
stream's deltas always reassemble to the non-streamed result. Malformed calls come back verbatim as content."""

from __future__ import annotations

import json
import random

import pytest

from edgemoe import config
from edgemoe.server.chat_format import OutputParser, Parsed
from edgemoe.server.reasoning import Reasoning, ReasoningParser
from edgemoe.server.tool_calls import TOOL_PARSERS, Content, ToolCall

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
          "units": {"type": ["string", "null"]}, "detail": {"type": "boolean"}, "at": {"type": "number"},
          "opts": {"type": "object"}, "tags": {"type": "array"}, "when": {"anyOf": [{"type": "integer"},
                                                                                   {"type": "null"}]}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("get_weather", "write_file")]


def call(name: str, **args: object) -> tuple[str, dict]:
    return name, args


def qcall(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


W = qcall("get_weather", '{"city": "Paris"}')
ROME, TOKYO = qcall("get_weather", '{"city": "Rome"}'), qcall("get_weather", '{"city": "東京"}')
BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
GLM = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"  # noqa: E501
CODER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"  # noqa: E501

# (id, format, reasoning: None | "closed" | "open", max_calls, text, expected (reasoning, content, calls))
CASES = [
    ("qwen-plain", "qwen", None, None, "Hello there.\n", ("", "Hello there.\n", [])),
    ("qwen-text-call", "qwen", None, None, f"Let me check.\n\n{W}",
     ("", "Let me check.", [call("get_weather", city="Paris")])),
    ("qwen-two-calls", "qwen", None, None, f"{W}\n{ROME}",
     ("", "", [call("get_weather", city="Paris"), call("get_weather", city="Rome")])),
    ("qwen-call-then-text", "qwen", None, None, f"{W}\n\nDone.", ("", "Done.", [call("get_weather", city="Paris")])),
    ("qwen-bad-json", "qwen", None, None, f"Hi\n{BAD_JSON}", ("", f"Hi\n{BAD_JSON}", [])),
    ("qwen-args-list", "qwen", None, None, qcall("f", "[1, 2]"), ("", qcall("f", "[1, 2]"), [])),
    ("qwen-no-name", "qwen", None, None, '<tool_call>\n{"arguments": {}}\n</tool_call>',
     ("", '<tool_call>\n{"arguments": {}}\n</tool_call>', [])),
    ("qwen-truncated", "qwen", None, None, 'ok <tool_call>\n{"name": "get_weather", "argu',
     ("", 'ok <tool_call>\n{"name": "get_weather", "argu', [])),
    ("qwen-no-end-tag", "qwen", None, None, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n',
     ("", "", [call("get_weather")])),
    ("qwen-strings-with-markup", "qwen", None, None,
     qcall("write_file", '{"code": "if (x) { y(\\"}\\"); } </tool_call> [", "n": 1}'),
     ("", "", [call("write_file", code='if (x) { y("}"); } </tool_call> [', n=1)])),
    ("qwen-escapes", "qwen", None, None, qcall("f", r'{"s": "a \\ b \" c \n d \u00e9"}'),
     ("", "", [call("f", s='a \\ b " c \n d é')])),
    ("qwen-quoted-args", "qwen", None, None, qcall("f", '"{\\"a\\": 1}"'), ("", "", [call("f", a=1)])),
    ("qwen-junk-after-object", "qwen", None, None, '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>',
     ("", '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>', [])),
    ("qwen-not-json", "qwen", None, None, "<tool_call>oops</tool_call> then",
     ("", "<tool_call>oops</tool_call> then", [])),
    ("qwen-nan", "qwen", None, None, qcall("f", '{"x": NaN}'), ("", qcall("f", '{"x": NaN}'), [])),
    ("qwen-mismatched", "qwen", None, None, '<tool_call>{"name": "f"] x', ("", '<tool_call>{"name": "f"] x', [])),
    ("qwen-lookalike", "qwen", None, None, "a < b and <tool_cal", ("", "a < b and <tool_cal", [])),
    ("qwen-bare-marker", "qwen", None, None, "see <tool_call>", ("", "see <tool_call>", [])),
    ("qwen-unicode", "qwen", None, None, f"日本 {TOKYO}",
     ("", "日本", [call("get_weather", city="東京")])),
    ("qwen-one-call-only", "qwen", None, 1, f"Sure. {W}{W} and more",
     ("", "Sure.", [call("get_weather", city="Paris")])),
    ("qwen-bad-then-good", "qwen", None, None, f"{BAD_JSON}\n{W}", ("", BAD_JSON, [call("get_weather", city="Paris")])),
    ("coder-typed", "qwen3_coder", None, None,
     "I will.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n<parameter=detail>\ntrue\n</parameter>\n<parameter=at>\n1.5\n</parameter>\n<parameter=opts>\n"
     '{"a": [1]}\n</parameter>\n<parameter=units>\nnull\n</parameter>\n<parameter=when>\nnull\n</parameter>\n'
     "</function>\n</tool_call>",
     ("", "I will.", [call("get_weather", city="New York", days=3, detail=True, at=1.5, opts={"a": [1]},
                           units="null", when=None)])),
    ("coder-multiline-markup", "qwen3_coder", None, None,
     "<tool_call>\n<function=write_file>\n<parameter=city>\nline 1\n</parameter> not the end\n<b>\n</parameter>\n"
     "<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>",
     ("", "", [call("write_file", city="line 1\n</parameter> not the end\n<b>", days="many")])),
    ("coder-two-calls", "qwen3_coder", None, None, f"{CODER}\n{CODER}",
     ("", "", [call("get_weather", city="Paris", days=3)] * 2)),
    ("coder-unknown-function", "qwen3_coder", None, None,
     "<tool_call>\n<function=other>\n<parameter=x>\n5\n</parameter>\n</function>\n</tool_call>",
     ("", "", [call("other", x="5")])),
    ("coder-no-function-end", "qwen3_coder", None, None,
     "<tool_call>\n<function=f>\n<parameter=x>\n5\n</parameter>\n</tool_call>",
     ("", "<tool_call>\n<function=f>\n<parameter=x>\n5\n</parameter>\n</tool_call>", [])),
    ("coder-truncated", "qwen3_coder", None, None, "<tool_call>\n<function=f>\n<parameter=x>\n5",
     ("", "<tool_call>\n<function=f>\n<parameter=x>\n5", [])),
    ("coder-no-end-tag", "qwen3_coder", None, None, CODER.removesuffix("</tool_call>"),
     ("", "", [call("get_weather", city="Paris", days=3)])),
    ("mistral-v3-list", "mistral", None, None,
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
     ("", "", [call("get_weather", city="Paris"), call("f")])),
    ("mistral-v3-object", "mistral", None, None, 'Ok.[TOOL_CALLS] {"name": "f", "arguments": {"a": "]"}}',
     ("", "Ok.", [call("f", a="]")])),
    ("mistral-v11", "mistral", None, None,
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": [1, {"y": 2}]}',
     ("", "", [call("get_weather", city="Paris"), call("f", x=[1, {"y": 2}])])),
    ("mistral-bad-item", "mistral", None, None, '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"arguments": {}}]',
     ("", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"arguments": {}}]', [])),
    ("mistral-truncated", "mistral", None, None, '[TOOL_CALLS] [{"name": "f", "argum',
     ("", '[TOOL_CALLS] [{"name": "f", "argum', [])),
    ("mistral-bad-name", "mistral", None, None, '[TOOL_CALLS]get weather[ARGS]{}',
     ("", "[TOOL_CALLS]get weather[ARGS]{}", [])),
    ("mistral-bare", "mistral", None, None, "x [TOOL_CALLS]", ("", "x [TOOL_CALLS]", [])),
    ("glm-typed", "glm", None, None,
     "I will.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n<arg_key>days"
     "</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1]}</arg_value>\n"
     "</tool_call>",
     ("", "I will.", [call("get_weather", city="New York", days=3, opts={"a": [1]})])),
    ("glm-two-calls", "glm", None, None, f"{GLM}\n{GLM}", ("", "", [call("get_weather", city="Paris", days=3)] * 2)),
    ("glm-no-args", "glm", None, None, "<tool_call>f\n</tool_call>", ("", "", [call("f")])),
    ("glm-markup-in-value", "glm", None, None,
     "<tool_call>write_file\n<arg_key>city</arg_key>\n<arg_value>a</arg_value> not the end\n<b></arg_value>\n"
     "</tool_call>", ("", "", [call("write_file", city="a</arg_value> not the end\n<b>")])),
    ("glm-junk", "glm", None, None, "<tool_call>get weather now</tool_call> ok",
     ("", "<tool_call>get weather now</tool_call> ok", [])),
    ("glm-no-name", "glm", None, None, "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     ("", "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", [])),
    ("glm-truncated", "glm", None, None, "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>5",
     ("", "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>5", [])),
    ("glm-no-end-tag", "glm", None, None, GLM.removesuffix("</tool_call>"),
     ("", "", [call("get_weather", city="Paris", days=3)])),
    ("glm-think-then-call", "glm", "closed", None, f"\n<think>Paris: one call.</think>\nChecking.\n{GLM}",
     ("Paris: one call.", "Checking.", [call("get_weather", city="Paris", days=3)])),
    ("think-then-call", "qwen", "closed", None, f"<think>\nWeather: call.\n</think>\n\nChecking.\n{W}",
     ("Weather: call.", "Checking.", [call("get_weather", city="Paris")])),
    ("think-opened-by-prompt", "qwen", "open", None, "\nr1\n\nr2 \n</think>\n\n  answer ",
     ("r1\n\nr2", "answer ", [])),
    ("think-cut-off", "qwen", "closed", None, "<think>\nlong thought", ("long thought", "", [])),
    ("think-none", "qwen", "closed", None, "  plain <think> later", ("", "  plain <think> later", [])),
    ("think-partial-tag", "qwen", "closed", None, "<thin", ("", "<thin", [])),
    ("think-call-inside", "qwen", "closed", None, f"<think>maybe {W}</think>{W}",
     (f"maybe {W}", "", [call("get_weather", city="Paris")])),
    ("think-no-tools", None, "closed", None, "<think>a</think>b", ("a", "b", [])),
]  # fmt: skip


def make_parser(fmt: str | None, reasoning: str | None, max_calls: int | None) -> OutputParser:
    tools = TOOL_PARSERS[fmt](TOOLS, max_calls) if fmt else None
    return OutputParser(ReasoningParser(reasoning == "open") if reasoning else None, tools)


def run(parser: OutputParser, chunks: list[str]) -> tuple[Parsed, list]:
    events = [e for c in chunks for e in parser.feed(c)] + parser.finish()
    out = Parsed()
    for e in events:
        if isinstance(e, ToolCall):
            assert e.index == len(out.calls)
            out.calls.append(e)
        elif isinstance(e, Reasoning):
            out.reasoning += e.text
        else:
            assert isinstance(e, Content)
            out.content += e.text
    return out, events


def cuts(text: str, rng: random.Random) -> list[list[str]]:
    """Every single cut, one character at a time, and random cuts into several pieces."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(30):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        out.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return out


@pytest.mark.parametrize("fmt,reasoning,max_calls,text,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_at_every_cut(fmt, reasoning, max_calls, text, expected):
    whole, _ = run(make_parser(fmt, reasoning, max_calls), [text])
    calls = [(c.name, json.loads(c.arguments)) for c in whole.calls]
    assert (whole.reasoning, whole.content, calls) == expected
    for chunks in cuts(text, random.Random(text)):
        parsed, events = run(make_parser(fmt, reasoning, max_calls), chunks)
        assert parsed == whole, chunks
        assert all(e.text for e in events if not isinstance(e, ToolCall))  # no empty deltas


def test_malformed_output_is_the_raw_text():
    """Whatever the format, output without a valid call is returned exactly as the model wrote it."""
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", "name", ":", "[TOOL_CALLS]", "<function=",
              "</function>", "<parameter=", "</parameter>", "[ARGS]", " ", "\n", "x"]  # fmt: skip
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        for fmt in TOOL_PARSERS:
            parsed, _ = run(make_parser(fmt, None, None), [text])
            if not parsed.calls:
                assert parsed.content == text, (fmt, text)
            chunked, _ = run(make_parser(fmt, None, None), list(text))
            assert chunked == parsed, (fmt, text)


def test_flag_names_match_the_parsers():
    """(harmony's messages, reasoning and calls together, are read by `edgemoe.server.harmony`)"""
    assert config.TOOL_PARSERS == ("auto", "none", *TOOL_PARSERS, "harmony")
