"""System (and developer) messages after the first turn, on a template that refuses them as Qwen3.5's does: accepted
by the chat APIs, rendered in place as the template's system turn, and the tokens before them are the previous
turn's prompt and answer (so the prefix cache holds them)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
import torch

from benchmarks.scripted_server import QWEN_TOKENS, InProcessServer, PromptLog, make_model
from edgemoe.server.chat_format import detect_formats, render_chat
from edgemoe.server.prompt import render_text
from edgemoe.server.protocol import ChatCompletionRequest
from edgemoe.tokenizer import Tokenizer

from .templates import REFUSING_TEMPLATE

MODEL = "qwen-refusing"
ANSWER = "Noted, my lord."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine thread shares 2 CI cores with the clients and the other servers
    server = InProcessServer(make_model(tmp_path_factory.mktemp("refusing") / MODEL, REFUSING_TEMPLATE, QWEN_TOKENS))
    log = PromptLog()
    server.engine_loop.engine.logits_processors.append(log)
    server.log = log
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)


def check_prefix(server, first_text: str) -> str:
    """Turn 2's prompt starts with turn 1's prompt and answer (its tokens, the end of turn included); the rest of
    turn 2's prompt, as text."""
    tok = server.script.tokenizer
    first, second = server.log.last(2)
    answer = tok.encode(first_text, add_special_tokens=False) + [server.script.end]
    assert second[: len(first) + len(answer)] == first + answer
    return tok.decode(second[len(first) + len(answer) :], skip_special_tokens=False)


def test_template_refuses_and_render_text_places_it(server):
    tok = server.script.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hail."}, {"role": "system", "content": "Now in verse."},
                {"role": "user", "content": "Again."}, {"role": "system", "content": "Stop."}]  # fmt: skip
    with pytest.raises(Exception, match="System message must be at the beginning"):
        tok.apply_chat_template(messages)
    text = render_text(tok, messages, True, None, {})
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\nHail."
        "<|im_end|>\n<|im_start|>system\nNow in verse.<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n"
        "<|im_start|>system\nStop.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_without_system_turns(tmp_path):
    """A template that folds the system prompt into the first user turn (as Gemma's) has no system turn to write: a
    later system message goes in as a user message."""
    template = (
        "{%- set first = messages[0].content + ' ' if messages[0].role == 'system' else '' %}"
        "{%- set msgs = messages[1:] if first else messages %}{%- for m in msgs %}"
        "{%- if m.role == 'system' %}{{- raise_exception('no') }}{%- endif %}"
        "{{- '<' + m.role + '>' + (first if loop.first else '') + m.content }}{%- endfor %}"
        "{%- if add_generation_prompt %}<bot>{%- endif %}"
    )
    tok = Tokenizer(make_model(tmp_path / "m", template, []))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                {"role": "system", "content": "b"}]  # fmt: skip
    assert render_text(tok, messages, True, None, {}) == "<user>s a<user>b<bot>"


def test_chat_and_developer_roles(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    messages = [{"role": "system", "content": "You serve the king."}, {"role": "user", "content": "Who goes there?"}]
    server.script.push(ANSWER, "Aye.")
    one = client.chat.completions.create(model=MODEL, messages=messages)
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "developer", "content": "Answer in one word."},
                 {"role": "user", "content": "Friend?"}]  # fmt: skip
    two = client.chat.completions.create(model=MODEL, messages=messages)
    assert two.choices[0].message.content == "Aye."
    rest = check_prefix(server, ANSWER)
    turns = "\n<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nFriend?<|im_end|>\n"
    assert rest == turns + "<|im_start|>assistant\n"


def test_responses(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    items = [{"role": "user", "content": "Who goes there?"}]
    server.script.push(ANSWER, "Aye.")
    one = client.responses.create(model=MODEL, input=items, instructions="You guard the gate.")
    items += [one.output[0].model_dump(exclude_none=True), {"role": "system", "content": "Be terse."},
              {"role": "user", "content": "Friend?"}]  # fmt: skip
    with client.responses.stream(model=MODEL, input=items, instructions="You guard the gate.") as stream:
        two = stream.get_final_response()
    assert two.output_text == "Aye."
    assert check_prefix(server, ANSWER).startswith("\n<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user")


def test_codex_request(server):
    """Codex's developer messages (one after the instructions, one later) on the refusing template."""
    body = json.loads((Path(__file__).parent / "fixtures" / "codex_request.json").read_text())
    body.pop("client_metadata")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    server.script.push("It says hello.")
    events = list(client.responses.create(**{**body, "model": MODEL}))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "It says hello."


def test_anthropic_system_and_count(server):
    """Anthropic's wire format has no system message after the first turn (only `system`): its requests render as
    chat's, and count_tokens counts the prompt the messages route runs."""
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=60)
    server.script.push(ANSWER)
    kw = dict(model=MODEL, system="You guard the gate.", messages=[{"role": "user", "content": "Who goes there?"}])
    message = client.messages.create(max_tokens=64, **kw)
    assert message.content[0].text == ANSWER
    assert client.messages.count_tokens(**kw).input_tokens == len(server.log.last(1)[0])


def test_tokenize_renders_the_same(server):
    tok = server.script.tokenizer
    messages = [{"role": "user", "content": "Hi."}, {"role": "system", "content": "Terse."}]
    req = ChatCompletionRequest.model_validate({"messages": messages})
    plan = render_chat(tok, detect_formats(tok), req)
    assert tok.decode(plan.prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>system\nTerse.<|im_end|>\n<|im_start|>assistant\n"
    )
