"""Codex CLI's requests through the official `openai` client, on scripted outputs.

`fixtures/codex_request.json` is a request body shaped as Codex builds it (openai/codex, codex-rs: `ResponsesApiRequest`
in `codex-api/src/common.rs`, the items of `protocol/src/models.rs`, the tools of `core/src/client_common.rs`): its
fields (`instructions`, `tools`, `tool_choice` "auto", `parallel_tool_calls`, `reasoning` with effort and summary,
`store` false, `stream` true, `include` ["reasoning.encrypted_content"], `prompt_cache_key`, `text.verbosity`,
`client_metadata`), its tools (functions with `strict`, the free-form `apply_patch` custom tool with Codex's lark
grammar, and the `web_search`, `image_generation`, `tool_search` and `namespace` tools that OpenAI's servers run) and
its input items as Codex serializes them (a developer message of several text parts, user messages, a reasoning item
with `encrypted_content` null, an assistant message, a `custom_tool_call` with its status and its output, a
`function_call` and its output, and a developer message after them). Texts are shortened to fit the demo model's
2,048-token context.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from edgemoe.server import responses

MODEL = "qwen-tools"
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "codex_request.json").read_text())
PATCH = next(i["input"] for i in FIXTURE["input"] if i["type"] == "custom_tool_call")
FIRST_TURN = FIXTURE["input"][:3]  # the developer message, AGENTS.md and environment, the user's request


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=tool_server.api_key, max_retries=0, timeout=60)


def create(client: openai.OpenAI, items: list[dict], stream: bool):
    """The fixture's body with `items` as its input, sent as the SDK sends it (`client_metadata` is not among the
    SDK's parameters: Codex's own client sends it, so it goes as an extra field)."""
    body = {**FIXTURE, "model": MODEL, "input": items, "stream": stream}
    extra = {"client_metadata": body.pop("client_metadata")}
    return client.responses.create(**body, extra_body=extra)


def test_tools_as_the_model_sees_them(capsys, monkeypatch):
    monkeypatch.setattr(responses, "_ignored_tool_types", set())
    conv = responses.parse(FIXTURE)
    responses.parse(FIXTURE)  # the second time: nothing more on stderr
    names = [t["function"]["name"] for t in conv.req.tools]
    assert names == ["exec_command", "update_plan", "apply_patch"]
    patch = conv.req.tools[2]["function"]
    assert patch["parameters"] == {"type": "object", "properties": {"input": {
        "type": "string", "description": "the tool's raw input text (not JSON)"}}, "required": ["input"]}  # fmt: skip
    assert patch["description"].startswith("Use the `apply_patch` tool") and "start: begin_patch hunk+" in patch[
        "description"]  # fmt: skip
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("'")[1] for line in lines] == ["web_search", "image_generation", "tool_search", "namespace"]
    messages = [(m.role, m.content) for m in conv.req.messages]
    assert messages[0] == ("system", FIXTURE["instructions"])
    assert messages[-2:] == [("developer", "<collaboration_mode># Collaboration Mode: Plan</collaboration_mode>"),
                             ("user", "Thanks. What is in it?")]  # fmt: skip
    calls = [m.tool_calls for m in conv.req.messages if m.tool_calls]
    assert calls[0][0]["function"] == {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})}
    assert conv.req.messages[4].reasoning_content == "The user wants a file."


def test_custom_tool_call_streamed(tool_server, client):
    tool_server.script.push(f'<tool_call>\n{json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})}'
                            "\n</tool_call>")  # fmt: skip
    events = list(create(client, FIRST_TURN, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    (call,) = events[-1].response.output
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", PATCH)
    assert call.call_id.startswith("call_") and events[2].item.input == "" and events[2].item.call_id == call.call_id
    assert events[3].delta == events[4].input == PATCH and events[3].item_id == call.id
    assert events[5].item.input == PATCH


def test_custom_tool_call_whole_and_a_later_turn(tool_server, client):
    tool_server.script.push('<tool_call>\n{"name": "apply_patch", "arguments": {"patch": "*** Begin Patch"}}'
                            "\n</tool_call>")  # fmt: skip
    first = create(client, FIRST_TURN, stream=False)
    (call,) = first.output
    assert (call.type, call.input) == ("custom_tool_call", "*** Begin Patch")  # one string, under another name
    tool_server.script.push("It says hello.")
    later = list(create(client, FIXTURE["input"], stream=True))
    assert later[-1].type == "response.completed" and later[-1].response.output_text == "It says hello."
    assert later[-1].response.usage.input_tokens > 1000


def test_refused(tool_server, client):
    bad_format = {**FIXTURE["tools"][2], "format": {"type": "regex"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", tools=[bad_format])
    assert err.value.body["param"] == "tools.0.format"
    orphan = [{"type": "custom_tool_call_output", "call_id": "call_none", "output": "x"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=orphan)
    assert err.value.body["param"] == "input.0.call_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id" and "stores nothing" in err.value.body["message"]
