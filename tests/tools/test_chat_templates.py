"""The chat templates the demo model and make-model checkpoints ship (`edgemoe/tools/chat_templates.py`): detected as
their family's tool-call format, rendered alike by transformers and by edgemoe, ChatML unchanged without tools, and a
call written in the rendered format parsed back by the server's parser."""

from __future__ import annotations

import json

import pytest

from edgemoe import demo_model_path
from edgemoe.models.registry import family_value
from edgemoe.server.chat_format import ChatFormats, detect_formats, parse_all, render_chat
from edgemoe.server.protocol import ChatCompletionRequest, parse_request
from edgemoe.tokenizer import Tokenizer
from edgemoe.tools.presets import FAMILIES
from edgemoe.tools.random_weights import tokenizer_files

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "18 C"},
]
# what a model of each format writes to make that call
WRITTEN = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>",
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
}


def family_tokenizer(tmp_path, family: str) -> Tokenizer:
    tokenizer, config = tokenizer_files(family)
    (tmp_path / "tokenizer.json").write_text(tokenizer)
    (tmp_path / "tokenizer_config.json").write_text(config)
    return Tokenizer(tmp_path)


def test_demo_template_renders_as_transformers_does() -> None:
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(demo_model_path()), Tokenizer(demo_model_path())
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(TURNS, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(TURNS, tools=tools) == want
    with_tools = ours.apply_chat_template(TURNS[:2], tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and json.dumps(TOOLS[0]) in with_tools


def test_without_tools_the_demo_template_is_the_chatml_it_was_trained_on() -> None:
    plain = [*TURNS[:2], {"role": "assistant", "content": "Fair."}, {"role": "user", "content": "And Rome?"}]
    text = Tokenizer(demo_model_path()).apply_chat_template(plain)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in plain) + (
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_make_model_templates_are_their_family_format(tmp_path, family: str) -> None:
    """Detected as the family's format; a conversation with tools renders through the server's path; the call the
    model would write in that format parses back to the call."""
    tok = family_tokenizer(tmp_path, family)
    formats = detect_formats(tok)
    tool_format = family_value(family, "TOOL_FORMAT")
    reasoning = family in ("qwen3_5_moe_text", "glm4_moe")  # their templates write <think> blocks: reasoning models
    assert formats == ChatFormats(tool_format, reasoning, True)
    body = {"messages": [TURNS[1], {**TURNS[2], "content": None}, TURNS[3]], "tools": TOOLS}
    plan = render_chat(tok, formats, parse_request(ChatCompletionRequest, body))
    text = tok.decode(plan.prompt_ids, skip_special_tokens=False)
    assert "get_weather" in text and "18 C" in text and "Weather of a city" in text
    parsed = parse_all(plan.parser(), WRITTEN[tool_format])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.content == ""


def test_demo_model_is_detected_as_qwen() -> None:
    assert detect_formats(Tokenizer(demo_model_path())) == ChatFormats("qwen", False, True)
