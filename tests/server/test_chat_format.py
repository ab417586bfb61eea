"""Per-model format detection and the rendering of conversations with tools through real jinja templates (no
server): what each family's template receives, and the 400s for conversations that cannot be rendered."""

from __future__ import annotations

import json

import pytest

from benchmarks.scripted_server import QWEN3_TEMPLATE, QWEN_TOKENS, make_model
from edgemoe import SamplingParams
from edgemoe.server.chat_format import ChatFormats, detect_formats, render_chat
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, parse_request
from edgemoe.tokenizer import Tokenizer
from edgemoe.tools.chat_templates import GLM

from .templates import CODER_TEMPLATE, GLM_TOKENS, MISTRAL_TEMPLATE, MISTRAL_TOKENS

# ChatML without a tools branch (the demo model's template before it had one)
PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return {
        "qwen": make_model(root / "qwen", QWEN3_TEMPLATE, QWEN_TOKENS),
        "coder": make_model(root / "coder", CODER_TEMPLATE, ["<tool_call>", "</tool_call>"]),
        "mistral": make_model(root / "mistral", MISTRAL_TEMPLATE, MISTRAL_TOKENS, special=True),
        "plain": make_model(root / "plain", PLAIN_TEMPLATE, []),
        "glm": make_model(root / "glm", GLM.strip(), GLM_TOKENS),
    }


def render(tok: Tokenizer, formats: ChatFormats, body: dict, **kw):
    return render_chat(tok, formats, parse_request(ChatCompletionRequest, body), **kw)


def text_of(tok: Tokenizer, plan) -> str:
    return tok.decode(plan.prompt_ids, skip_special_tokens=False)


def test_detection(folders):
    qwen, coder, mistral = (Tokenizer(folders[k]) for k in ("qwen", "coder", "mistral"))
    assert detect_formats(qwen) == ChatFormats("qwen", True, True)
    assert detect_formats(coder) == ChatFormats("qwen3_coder", False, True)
    assert detect_formats(mistral) == ChatFormats("mistral", False, True)
    assert detect_formats(Tokenizer(folders["plain"])) == ChatFormats(None, False, False)
    assert detect_formats(qwen, "mistral", "none") == ChatFormats("mistral", False, True)  # the flags win
    assert detect_formats(Tokenizer(folders["glm"])) == ChatFormats("glm", True, True)


def test_glm_template(folders):
    """GLM-4.5's shape: the calls of a turn as name and argument pairs, the results in one observation turn, the
    reasoning kept in its <think> block; thinking switched off by an empty block after the generation prompt."""
    glm = Tokenizer(folders["glm"])
    formats = detect_formats(glm)
    text = text_of(glm, render(glm, formats, {"messages": TURNS, "tools": TOOLS}))
    call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools") and '"name": "get_weather"' in text
    assert f"<|assistant|>\n<think>Two calls.</think>\n{call}\n<tool_call>get_weather" in text
    assert "<|observation|>\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>" in text
    assert text.endswith("</tool_response><|assistant|>")
    body = {"messages": TURNS[1:2], "chat_template_kwargs": {"enable_thinking": False}}
    plan = render(glm, formats, body)
    assert text_of(glm, plan).endswith("<|user|>\nWeather in Paris and Rome?<|assistant|>\n<think></think>")
    assert not plan.in_reasoning


def test_qwen_conversation_with_tool_turns(folders):
    tok = Tokenizer(folders["qwen"])
    plan = render(tok, detect_formats(tok), {"messages": TURNS, "tools": TOOLS})
    text = text_of(tok, plan)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # tools reach the template as given
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<think>\nTwo calls.\n</think>\n\n{call}" in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n") and plan.parser().tools is not None and not plan.in_reasoning


def test_qwen_switches_and_forced_calls(folders):
    tok = Tokenizer(folders["qwen"])
    formats, user = detect_formats(tok), [{"role": "user", "content": "hi"}]
    off = render(tok, formats, {"messages": user, "chat_template_kwargs": {"enable_thinking": False}})
    assert text_of(tok, off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    required = render(tok, formats, {"messages": user, "tools": TOOLS, "tool_choice": "required"})
    assert text_of(tok, required).endswith("<|im_start|>assistant\n") and "call_0" in required.grammar
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = render(tok, formats, {"messages": user, "tools": TOOLS, "tool_choice": choice})
    assert "get_weather" in named.grammar and "call_1" not in named.grammar  # (tests/server/test_constraints.py)
    auto = render(tok, formats, {"messages": user, "tools": TOOLS})
    assert auto.grammar is None and auto.sampling([SamplingParams()])[0].grammar is None
    none = render(tok, formats, {"messages": user, "tools": TOOLS, "tool_choice": "none"})
    assert "# Tools" not in text_of(tok, none) and none.parser().tools is None and none.grammar is None
    opened = render(tok, formats, {"messages": user}, prefill="<think>\n")
    assert opened.in_reasoning


def test_coder_and_mistral_templates(folders):
    coder = Tokenizer(folders["coder"])
    text = text_of(coder, render(coder, detect_formats(coder), {"messages": TURNS, "tools": TOOLS}))
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>" in text
    mistral = Tokenizer(folders["mistral"])
    formats = detect_formats(mistral)
    plan = render(mistral, formats, {"messages": TURNS[1:], "tools": TOOLS})
    text = text_of(mistral, plan)
    ids = [c["id"] for c in json.loads(text.split("[TOOL_CALLS]")[1].split("<|endoftext|>")[0])]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2  # call ids mapped for the template
    assert f'"call_id": "{ids[1]}"}}[/TOOL_RESULTS]' in text  # ... and the results' the same way
    assert plan.sampling([SamplingParams()])[0].skip_special_tokens is False


BAD = [  # (id, body, param)
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("tool-not-function", {"tools": [{"type": "web_search"}]}, "tools"),
    ("tool-twice", {"tools": TOOLS * 2}, "tools"),
    ("choice-unknown-function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("choice-bad", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("arguments-not-object", {"messages": [TURNS[1], {**TURNS[2], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("arguments-not-json", {"messages": [TURNS[1], {**TURNS[2], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("call-without-id", {"messages": [TURNS[1], {**TURNS[2], "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls.0.id"),
    ("unknown-tool-call-id", {"messages": [*TURNS[:3], {**TURNS[3], "tool_call_id": "call_9"}]},
     "messages.3.tool_call_id"),
    ("tool-result-first", {"messages": [TURNS[3]]}, "messages.0.tool_call_id"),
    ("assistant-empty", {"messages": [TURNS[1], {"role": "assistant"}]}, "messages.1.content"),
    ("user-no-content", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("reserved-kwarg", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_conversations(folders, body, param):
    tok = Tokenizer(folders["qwen"])
    with pytest.raises(RequestError) as err:
        render(tok, detect_formats(tok), {"messages": [{"role": "user", "content": "hi"}], **body})
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_template_without_tools_says_so(folders):
    tok = Tokenizer(folders["plain"])
    formats = detect_formats(tok)
    for body in ({"tools": TOOLS}, {"messages": TURNS[1:4]}):
        with pytest.raises(RequestError, match="chat template does not support tools"):
            render(tok, formats, {"messages": [{"role": "user", "content": "hi"}], **body})
    render(tok, formats, {"messages": TURNS[:2], "tools": TOOLS, "tool_choice": "none"})  # tools unused: fine
