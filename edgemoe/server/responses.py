"""The OpenAI Responses API (`POST /v1/responses`), stateless: requests converted to the OpenAI chat form that
`chat_format` renders; answers as output items (reasoning, message, function calls), streamed as Responses events.

Nothing is stored: a conversation is sent whole each time (`previous_response_id` is refused). Input items: messages
(text parts), `function_call`, `function_call_output` (answering a call made before it), `reasoning`. `reasoning.effort`
"none" turns the template's `enable_thinking` off, any other effort on.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgemoe.server.answer import Finish, Usage, Writer
from edgemoe.server.chat_format import ChatPlan, Conversation, Event, Parsed, new_call_id
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, parse_request
from edgemoe.server.reasoning import Reasoning
from edgemoe.server.tool_calls import Content, ToolCall

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

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


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param, "invalid_value")


def parse(body: object) -> Conversation:
    req = parse_request(ResponsesRequest, body)
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise _bad(f"{name} is not supported: this server stores nothing; send the whole conversation", name)
    if req.background:
        raise _bad("background is not supported", "background")
    if req.text and req.text.get("format", {"type": "text"}) != {"type": "text"}:
        raise _bad("text.format: only text is supported", "text.format")
    chat = {"model": req.model, "messages": _messages(req), "stream": req.stream,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls}  # fmt: skip
    kwargs = {}
    if req.reasoning and req.reasoning.get("effort") is not None:
        kwargs["enable_thinking"] = req.reasoning["effort"] != "none"
    conv_req = parse_request(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})
    return Conversation(conv_req, kwargs, wire=req)


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
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise _bad(f"{where}.{key}: must be a non-empty string", f"{where}.{key}")
            if not isinstance(_json(item["arguments"]), dict):
                raise _bad(f"{where}.arguments: must be a JSON object", f"{where}.arguments")
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise _bad(f"{where}.call_id: {item.get('call_id')!r} answers no function_call before it",
                           f"{where}.call_id")  # fmt: skip
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
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
    """Responses' flat function tools -> chat's nested ones."""
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function":
            raise _bad(f"tools.{i}.type: {t.get('type')!r} tools are not supported (only function)", "tools")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out or None


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def usage_body(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}  # fmt: skip


class ResponsesWriter(Writer):
    """One request's response, whole or as its event stream: response.created, response.in_progress, the output
    items' events, response.completed (or .incomplete) with the usage."""

    def __init__(self, conv: Conversation, plan: ChatPlan, model: str) -> None:
        self.req: ResponsesRequest = conv.wire
        self.parallel, self.model = plan.parallel, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.items = _Items()
        self.reason: str | None = None  # the engine's finish reason, once the answer has ended

    def _response(self, output: list[dict], finish: str | None, usage: Usage | None) -> dict:
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": self.parallel,
            "previous_response_id": None, "reasoning": self.req.reasoning or {"effort": None, "summary": None},
            "store": False, "temperature": 1.0 if self.req.temperature is None else self.req.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": self.req.tool_choice or "auto",
            "tools": self.req.tools or [], "top_p": 1.0 if self.req.top_p is None else self.req.top_p,
            "truncation": "disabled", "metadata": self.req.metadata or {},
            "usage": None if usage is None else usage_body(usage),
        }  # fmt: skip

    def whole(self, choices: list[tuple[Parsed, Finish]], usage: Usage) -> dict:
        (out, finish), *_ = choices
        items = [_reasoning(f"rs_{uuid.uuid4().hex}", out.reasoning)] if out.reasoning else []
        items += [_message(f"msg_{uuid.uuid4().hex}", out.content, "completed")] if out.content else []
        items += [_call(f"fc_{uuid.uuid4().hex}", new_call_id(), c.name, c.arguments, "completed") for c in out.calls]
        return self._response(items, finish.reason, usage)

    def head(self) -> list[str]:
        return [self.items.event(f"response.{kind}", response=self._response([], None, None))
                for kind in ("created", "in_progress")]  # fmt: skip

    def output(self, index: int, events: list[Event], finish: Finish | None) -> list[str]:
        """Every event kind goes through `_Items`, which keeps the output's items in order."""
        frames = [frame for e in events for frame in self.items.add(e)]
        if finish is not None:
            self.reason = finish.reason
            frames += self.items.close()
        return frames

    def end(self, usage: Usage) -> list[str]:
        final = self._response(self.items.done, self.reason, usage)
        return [self.items.event(f"response.{final['status']}", response=final)]

    def error(self, exc: RequestError) -> list[str]:
        return [self.items.event("error", code=exc.code, message=exc.message, param=exc.param)]


class _Items:
    """The events of one response's output items, in order: a reasoning or message item stays open while its text
    grows; a function call is whole when it comes."""

    def __init__(self) -> None:
        self.numbers = itertools.count()
        self.done: list[dict] = []  # finished items
        self.item: dict | None = None  # the open item: its type, id and text so far

    def event(self, kind: str, **fields: object) -> str:
        data = json.dumps({"type": kind, "sequence_number": next(self.numbers), **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def add(self, e: Reasoning | Content | ToolCall) -> list[str]:
        kind = "function_call" if isinstance(e, ToolCall) else "reasoning" if isinstance(e, Reasoning) else "message"
        out = self.close() if self.item is not None and self.item["type"] != kind else []
        at = len(self.done)
        if isinstance(e, ToolCall):
            call = _call(f"fc_{uuid.uuid4().hex}", new_call_id(), e.name, "", "in_progress")
            ids = {"item_id": call["id"], "output_index": at}
            self.done.append({**call, "arguments": e.arguments, "status": "completed"})
            return out + [
                self.event("response.output_item.added", output_index=at, item=call),
                self.event("response.function_call_arguments.delta", **ids, delta=e.arguments),
                self.event("response.function_call_arguments.done", **ids, arguments=e.arguments, name=e.name),
                self.event("response.output_item.done", output_index=at, item=self.done[-1]),
            ]
        ids = {"output_index": at, "content_index": 0}
        if self.item is None:
            reasoning = kind == "reasoning"
            self.item = {"type": kind, "id": f"{'rs' if reasoning else 'msg'}_{uuid.uuid4().hex}", "text": ""}
            added = _reasoning(self.item["id"], "") if reasoning else _message(self.item["id"], "", "in_progress")
            part = {"type": "reasoning_text", "text": ""} if reasoning else added["content"][0]
            out += [self.event("response.output_item.added", output_index=at, item={**added, "content": []}),
                    self.event("response.content_part.added", item_id=self.item["id"], **ids, part=part)]  # fmt: skip
        self.item["text"] += e.text
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", item_id=self.item["id"], **ids, delta=e.text)]
        delta = self.event("response.output_text.delta", item_id=self.item["id"], **ids, delta=e.text, logprobs=[])
        return out + [delta]

    def close(self) -> list[str]:
        """End the open item, if any."""
        if self.item is None:
            return []
        item, at = self.item, len(self.done)
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        if item["type"] == "reasoning":
            done = _reasoning(item["id"], item["text"])
            text = self.event("response.reasoning_text.done", **ids, text=item["text"])
        else:
            done = _message(item["id"], item["text"], "completed")
            text = self.event("response.output_text.done", **ids, text=item["text"], logprobs=[])
        self.done.append(done)
        self.item = None
        return [text, self.event("response.content_part.done", **ids, part=done["content"][0]),
                self.event("response.output_item.done", output_index=at, item=done)]  # fmt: skip


def _reasoning(ident: str, text: str) -> dict:
    return {"type": "reasoning", "id": ident, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message(ident: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": ident, "role": "assistant", "status": status, "content": content}


def _call(ident: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip
