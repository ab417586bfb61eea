"""The OpenAI Responses API's answers (`responses.py` converts its requests): output items (reasoning, message,
function calls, custom tool calls), whole or streamed as Responses events."""

from __future__ import annotations

import itertools
import json
import time
import uuid

from edgemoe.server.answer import Finish, Usage, Writer
from edgemoe.server.chat_format import ChatPlan, Conversation, Event, Parsed
from edgemoe.server.protocol import RequestError
from edgemoe.server.reasoning import Reasoning
from edgemoe.server.responses import ResponsesRequest, custom_input
from edgemoe.server.tool_calls import Content, ToolCall


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
        self.items = _Items(self.req.custom_tools)
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
            "text": {"format": (self.req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": self.req.tool_choice or "auto",
            "tools": self.req.tools or [], "top_p": 1.0 if self.req.top_p is None else self.req.top_p,
            "truncation": "disabled", "metadata": self.req.metadata or {},
            "usage": None if usage is None else usage_body(usage),
        }  # fmt: skip

    def whole(self, choices: list[tuple[Parsed, Finish]], usage: Usage) -> dict:
        (out, finish), *_ = choices
        items = [_reasoning(f"rs_{uuid.uuid4().hex}", out.reasoning)] if out.reasoning else []
        items += [_message(f"msg_{uuid.uuid4().hex}", out.content, "completed")] if out.content else []
        items += [self.items.call(c, "completed") for c in out.calls]
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
    grows; a call is whole when it comes. `custom`: the names of the request's custom tools."""

    def __init__(self, custom: frozenset[str]) -> None:
        self.custom = custom
        self.numbers = itertools.count()
        self.done: list[dict] = []  # finished items
        self.item: dict | None = None  # the open item: its type, id and text so far

    def event(self, kind: str, **fields: object) -> str:
        data = json.dumps({"type": kind, "sequence_number": next(self.numbers), **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def call(self, call: ToolCall, status: str) -> dict:
        """A finished call's item: a custom tool's with its raw input, a function's with its arguments."""
        if call.name in self.custom:
            return {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}", "call_id": call.id,
                    "name": call.name, "input": custom_input(call.arguments)}  # fmt: skip
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}  # fmt: skip

    def _call_events(self, call: ToolCall) -> list[str]:
        at, done = len(self.done), self.call(call, "completed")
        self.done.append(done)
        ids = {"item_id": done["id"], "output_index": at}
        if done["type"] == "custom_tool_call":
            kind, text = "custom_tool_call_input", done["input"]
            added, finished = {**done, "input": ""}, {"input": text}
        else:
            kind, text = "function_call_arguments", done["arguments"]
            added, finished = {**done, "arguments": "", "status": "in_progress"}, {"arguments": text, "name": call.name}
        return [self.event("response.output_item.added", output_index=at, item=added),
                self.event(f"response.{kind}.delta", **ids, delta=text),
                self.event(f"response.{kind}.done", **ids, **finished),
                self.event("response.output_item.done", output_index=at, item=done)]  # fmt: skip

    def add(self, e: Reasoning | Content | ToolCall) -> list[str]:
        kind = "call" if isinstance(e, ToolCall) else "reasoning" if isinstance(e, Reasoning) else "message"
        out = self.close() if self.item is not None and self.item["type"] != kind else []
        if isinstance(e, ToolCall):
            return out + self._call_events(e)
        at = len(self.done)
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
