"""The OpenAI Responses API (`POST /v1/responses`), stateless: requests converted to the OpenAI chat form that
`chat_format` renders (the answer's writer: `responses_writer.py`).

Nothing is stored: a conversation is sent whole each time (`previous_response_id` is refused). Input items: messages
(text parts), `function_call` and `custom_tool_call`, their `function_call_output` and `custom_tool_call_output`
(each answering a call made before it), `reasoning`. `reasoning.effort` "none" turns the template's
`enable_thinking` off, any other effort on. `text.format` json_schema or json_object: the answer is that JSON
(`constraints.py`).

Tools: `function` tools as chat's; a `custom` tool (free-form text input, as Codex's `apply_patch`) is offered to the
model as a function of one string argument, `input`, its grammar (if any) in the description, and its calls come
back as `custom_tool_call` items holding that string. Other tool types run on OpenAI's servers (web search, image
generation, tool search, namespaces of deferred tools): they are ignored, with one line on stderr the first time a
type is seen, so that an agent that always sends them (Codex) still works.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgemoe.server.chat_format import Conversation
from edgemoe.server.constraints import response_schema
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, parse_request

_TEXT_PARTS = ("input_text", "output_text", "text")
CUSTOM_ARGUMENT = "input"  # the one argument of the function a custom tool is offered as
_ignored_tool_types: set[str] = set()  # announced once each


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # store, include, prompt_cache_key, ...: nothing to do

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    reasoning: dict | None = None
    text: dict | None = None
    metadata: dict | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None

    @property
    def custom_tools(self) -> frozenset[str]:
        """The names of the request's custom tools: their calls are written as `custom_tool_call` items."""
        return frozenset(t.get("name") for t in self.tools or [] if t.get("type") == "custom")


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param, "invalid_value")


def parse(body: object) -> Conversation:
    req = parse_request(ResponsesRequest, body)
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise _bad(f"{name} is not supported: this server stores nothing; send the whole conversation", name)
    if req.background:
        raise _bad("background is not supported", "background")
    fmt = (req.text or {}).get("format")
    response_schema(fmt, "text.format")  # (checked here to name the field)
    chat = {"model": req.model, "messages": _messages(req), "stream": req.stream,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": fmt}  # fmt: skip
    kwargs = {}
    if req.reasoning and req.reasoning.get("effort") is not None:
        kwargs["enable_thinking"] = req.reasoning["effort"] != "none"
        if kwargs["enable_thinking"]:  # harmony's templates take the effort itself
            kwargs["reasoning_effort"] = req.reasoning["effort"]
    conv_req = parse_request(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})
    return Conversation(conv_req, kwargs, wire=req, fields={"reasoning_effort": "reasoning.effort"})


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of text parts", where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}.{j}: {kind!r} parts are not supported (only text)", f"{where}.{j}")
    return "".join(part["text"] for part in content)


def _strings(item: dict, where: str, *keys: str) -> None:
    for key in keys:
        if not isinstance(item.get(key), str) or not item[key]:
            raise _bad(f"{where}.{key}: must be a non-empty string", f"{where}.{key}")


def _call(item: dict, where: str) -> dict:
    """A `function_call` or `custom_tool_call` item -> a chat tool call (a custom call's input as its argument)."""
    if item["type"] == "custom_tool_call":
        _strings(item, where, "call_id", "name")
        if not isinstance(item.get("input"), str):
            raise _bad(f"{where}.input: must be a string", f"{where}.input")
        arguments = json.dumps({CUSTOM_ARGUMENT: item["input"]}, ensure_ascii=False)
    else:
        _strings(item, where, "call_id", "name", "arguments")
        if not isinstance(_json(item["arguments"]), dict):
            raise _bad(f"{where}.arguments: must be a JSON object", f"{where}.arguments")
        arguments = item["arguments"]
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def _messages(req: ResponsesRequest) -> list[dict]:
    """Input items -> OpenAI chat messages: an assistant's message and the calls after it become one message."""
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning, calls = "", set()
    for i, item in enumerate(items):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role: must be user, system, developer or assistant", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, where)
            calls.add(call["id"])
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if item.get("call_id") not in calls:
                raise _bad(f"{where}.call_id: {item.get('call_id')!r} answers no call before it", f"{where}.call_id")
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []  # (encrypted_content: not ours to read)
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            continue
        else:
            raise _bad(f"{where}.type: {kind!r} items are not supported", f"{where}.type")
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, ""
    return out


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> chat's nested ones; custom tools as functions of one string; the rest
    ignored."""
    out = []
    for i, t in enumerate(tools or []):
        kind = t.get("type")
        if kind == "function":
            out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
        elif kind == "custom":
            out.append(_custom_function(t, f"tools.{i}"))
        elif not isinstance(kind, str):
            raise _bad(f"tools.{i}.type: missing", f"tools.{i}.type")
        elif kind not in _ignored_tool_types:
            _ignored_tool_types.add(kind)
            print(f"edgemoe: responses: ignoring tools of type {kind!r} (this server offers the model function and "
                  "custom tools only)", file=sys.stderr, flush=True)  # fmt: skip
    return out or None


def _custom_function(tool: dict, where: str) -> dict:
    """A custom tool as a function whose one argument is the tool's raw input."""
    description, fmt = tool.get("description", ""), tool.get("format", {"type": "text"})
    if not isinstance(description, str):
        raise _bad(f"{where}.description: must be a string", f"{where}.description")
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise _bad(f'{where}.format: must be {{"type": "text"}} or {{"type": "grammar", ...}}', f"{where}.format")
    if fmt["type"] == "grammar":
        if not isinstance(fmt.get("definition"), str) or not isinstance(fmt.get("syntax"), str):
            raise _bad(f"{where}.format: a grammar needs a syntax and a definition", f"{where}.format")
        description += f"\n\nThe input is text in this {fmt['syntax']} grammar:\n{fmt['definition']}"
    text = {"type": "string", "description": "the tool's raw input text (not JSON)"}
    parameters = {"type": "object", "properties": {CUSTOM_ARGUMENT: text}, "required": [CUSTOM_ARGUMENT]}
    return {"type": "function", "function": {"name": tool.get("name"), "description": description.strip(),
                                             "parameters": parameters}}  # fmt: skip


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def custom_input(arguments: str) -> str:
    """A custom tool's raw input from the arguments of the function it was offered as: the `input` string, or the
    one string the model gave under another name; else the arguments' JSON as they are (the tool then says what is
    wrong with them, as it would of any malformed input)."""
    args = json.loads(arguments)
    strings = [v for v in args.values() if isinstance(v, str)]
    if isinstance(args.get(CUSTOM_ARGUMENT), str):
        return args[CUSTOM_ARGUMENT]
    return strings[0] if len(args) == 1 and strings else arguments
