"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): requests converted to the OpenAI
chat form that `chat_format` renders, answers as Anthropic messages, streams as Anthropic's event sequence, errors in
Anthropic's shape.

Mapping: `system` -> a system message; `tool_use` blocks -> the assistant's tool calls; `tool_result` blocks -> tool
messages (each must answer a `tool_use` made before it); `thinking` blocks -> the assistant's reasoning (templates
that show past reasoning get it back); a last assistant message -> the start of the answer; `output_config.format`
-> the required JSON (`constraints.py`). `thinking` switches the template's `enable_thinking` (the token budget is
not enforced). `max_tokens` is capped to what the context has left, so that an agent's fixed large value still works
on a short context.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgemoe.server.answer import Finish, Usage, Writer
from edgemoe.server.chat_format import ChatPlan, Conversation, Parsed
from edgemoe.server.constraints import response_schema
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, parse_request
from edgemoe.server.reasoning import Reasoning
from edgemoe.server.tool_calls import Content, ToolCall

SIGNATURE = "edgemoe"  # thinking blocks carry a signature; ours is not checked when a client sends one back
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    """Routes whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # agents send fields that change nothing here

    model: str
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # required by /v1/messages, not by count_tokens
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param, "invalid_value")


def _text(block: dict, key: str, where: str) -> str:
    if not isinstance(block.get(key), str):
        raise _bad(f"{where}.{key}: must be a string", f"{where}.{key}")
    return block[key]


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of text blocks", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}.{j}: {kind!r} blocks are not supported here (only text)", f"{where}.{j}")
    return "\n".join(_text(b, "text", f"{where}.{j}") for j, b in enumerate(content))


def parse(body: object, count_only: bool = False) -> Conversation:
    req = parse_request(MessagesRequest, body)
    if req.max_tokens is None and not count_only:
        raise RequestError(400, "max_tokens: Field required", "max_tokens", "missing_required_parameter")
    fmt = (req.output_config or {}).get("format")
    response_schema(fmt, "output_config.format")  # (checked here to name the field)
    messages, prefill = _messages(req)
    chat = {"model": req.model, "messages": messages, "stream": req.stream, "stop": req.stop_sequences,
            "response_format": fmt,
            "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            **_tools(req)}  # fmt: skip
    kwargs = {}
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking.type: must be enabled, adaptive or disabled", "thinking.type")
        kwargs["enable_thinking"] = kind != "disabled"
    conv_req = parse_request(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})
    return Conversation(conv_req, kwargs, prefill, fit_max_tokens=True, wire=req)


def _messages(req: MessagesRequest) -> tuple[list[dict], str]:
    """Anthropic messages -> OpenAI chat messages, and the answer's given start (a last assistant message)."""
    out: list[dict] = [{"role": "system", "content": _texts(req.system, "system")}] if req.system else []
    calls: set[str] = set()
    prefill = ""
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, reasoning, tool_calls, results = [], [], [], []
        for j, b in enumerate(blocks):
            where, kind = f"messages.{i}.content.{j}", b.get("type")
            if kind == "text":
                texts.append(_text(b, "text", where))
            elif m.role == "assistant" and kind == "thinking":
                reasoning.append(_text(b, "thinking", where))
            elif m.role == "assistant" and kind == "redacted_thinking":
                pass  # encrypted by another server: nothing a local model can read
            elif m.role == "assistant" and kind == "tool_use":
                ident, name = _text(b, "id", where), _text(b, "name", where)
                if not isinstance(b.get("input"), dict):
                    raise _bad(f"{where}.input: must be an object", f"{where}.input")
                calls.add(ident)
                tool_calls.append({"id": ident, "type": "function",
                                   "function": {"name": name, "arguments": json.dumps(b["input"])}})  # fmt: skip
            elif m.role == "user" and kind == "tool_result":
                ident = _text(b, "tool_use_id", where)
                if ident not in calls:
                    raise _bad(f"{where}.tool_use_id: {ident!r} answers no tool_use made before it", where)
                text = _texts(b.get("content", ""), f"{where}.content")
                results.append({"role": "tool", "tool_call_id": ident, "content": text})
            else:
                raise _bad(f"{where}.type: {kind!r} blocks are not supported in {m.role} messages", f"{where}.type")
        if m.role == "user":
            out += results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])
        elif i == len(req.messages) - 1 and not tool_calls:
            prefill = "".join(texts)  # Anthropic: the model continues a last assistant message
        else:
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            out.append(msg)
    return out, prefill


def _tools(req: MessagesRequest) -> dict:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.get("type", "custom") != "custom":
            message = f"tools.{i}.type: {t.get('type')!r} tools (run by Anthropic's servers) are not supported"
            raise _bad(message, "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools.{i}.input_schema: must be a JSON schema object", f"tools.{i}.input_schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if "description" in t:
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    out: dict = {"tools": tools or None}
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise _bad("tool_choice.type: must be auto, any, tool or none", "tool_choice.type")
        names = {"auto": "auto", "any": "required", "none": "none"}
        out["tool_choice"] = names.get(kind) or {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def stop_reason(reason: str, stop: str | int | None, called: bool) -> tuple[str, str | None]:
    if reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    return ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)


def usage_body(usage: Usage) -> dict:
    """Anthropic's count: `input_tokens` is the prompt's uncached rest, `cache_read_input_tokens` what the prefix
    cache held (nothing is written at a client's request: `cache_creation_input_tokens` stays 0)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}  # fmt: skip


class MessagesWriter(Writer):
    """One request's Anthropic message, whole or as its event stream: message_start (with the first output, when
    the prompt's cached share is known), per block content_block_start / _delta... / _stop, message_delta (with the
    whole usage, as Anthropic's counts there are cumulative), message_stop."""

    call_prefix = "toolu_"

    def __init__(self, conv: Conversation, plan: ChatPlan, model: str) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.index = -1  # the last block's
        self.block: str | None = None  # the open block's kind
        self.stop: tuple[str, str | None] = ("end_turn", None)  # stop_reason, stop_sequence

    def _message(self, content: list[dict], reason: str | None, stop: str | None, usage: Usage) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": usage_body(usage)}  # fmt: skip

    def whole(self, choices: list[tuple[Parsed, Finish]], usage: Usage) -> dict:
        (out, finish), *_ = choices
        content = [{"type": "thinking", "thinking": out.reasoning, "signature": SIGNATURE}] if out.reasoning else []
        content += [{"type": "text", "text": out.content}] if out.content else []
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in out.calls]  # fmt: skip
        return self._message(content, *stop_reason(finish.reason, finish.stop, finish.called), usage)

    def begin(self, usage: Usage) -> list[str]:
        return [_event("message_start", message=self._message([], None, None, usage))]

    def _open(self, kind: str, e: Content | Reasoning | ToolCall) -> list[str]:
        """Close the open block unless `e` continues it (a tool_use block holds one call), and open one for `e`."""
        frames = []
        if self.block is not None and (kind != self.block or kind == "tool_use"):
            frames += self._close()
        if self.block is None:
            self.index, self.block = self.index + 1, kind
            frames.append(_event("content_block_start", index=self.index, content_block=_start(e)))
        return frames

    def _close(self) -> list[str]:
        """Close the open block (a thinking block gets its signature first)."""
        sign = {"type": "signature_delta", "signature": SIGNATURE}
        frames = [_delta(self.index, sign)] if self.block == "thinking" else []
        self.block = None
        return frames + [_event("content_block_stop", index=self.index)]

    def content(self, index: int, text: str) -> list[str]:
        return self._open("text", Content(text)) + [_delta(self.index, {"type": "text_delta", "text": text})]

    def reasoning(self, index: int, text: str) -> list[str]:
        delta = {"type": "thinking_delta", "thinking": text}
        return self._open("thinking", Reasoning(text)) + [_delta(self.index, delta)]

    def tool_call(self, index: int, call: ToolCall) -> list[str]:
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        return self._open("tool_use", call) + [_delta(self.index, delta)]

    def finish(self, index: int, finish: Finish) -> list[str]:
        self.stop = stop_reason(finish.reason, finish.stop, finish.called)
        return self._close() if self.block is not None else []

    def end(self, usage: Usage) -> list[str]:
        reason, stop = self.stop
        delta = _event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop}, usage=usage_body(usage))
        return [delta, _event("message_stop")]

    def error(self, exc: RequestError) -> list[str]:
        return [_event("error", error=error_body(exc.status, exc.message)["error"])]


def _start(e: Content | Reasoning | ToolCall) -> dict:
    if isinstance(e, ToolCall):
        return {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
    if isinstance(e, Reasoning):
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _delta(index: int, delta: dict) -> str:
    return _event("content_block_delta", index=index, delta=delta)


def _event(kind: str, **fields: object) -> str:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"
