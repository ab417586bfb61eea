"""OpenAI's chat completions (with tool calls and `reasoning_content`) and text completions: their writers over the
answer loop (`answer.py`), whole responses and SSE chunks.

A chat stream sends what each choice's parser returns as it returns it: `content` and `reasoning_content` deltas,
and per tool call one delta with its index, id and name, then one with its arguments. `finish_reason` is
`tool_calls` when a choice called a tool and stopped. Usage counts the prompt tokens the prefix cache held in
`prompt_tokens_details.cached_tokens`, as OpenAI's API does.
"""

from __future__ import annotations

import json
import time
import uuid

from edgemoe.server.answer import Finish, Usage, Writer
from edgemoe.server.chat_format import ChatPlan, Conversation, Event, Parsed
from edgemoe.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse_request
from edgemoe.server.tool_calls import ToolCall


def parse(body: object) -> Conversation:
    return Conversation(parse_request(ChatCompletionRequest, body))


def finish_reason(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sse(body: dict | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class _OpenAIWriter(Writer):
    """What both OpenAI completion APIs share: one id and one timestamp for every chunk, the usage chunk, [DONE]."""

    prefix, whole_object, chunk_object = "", "", ""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model, self.include_usage = model, include_usage
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choice: dict) -> str:
        body = self._envelope(self.chunk_object, [choice])
        if self.include_usage:  # OpenAI: with include_usage, every other chunk says usage: null
            body["usage"] = None
        return sse(body)

    def _whole(self, choices: list[dict], usage: Usage) -> dict:
        return {**self._envelope(self.whole_object, choices), "usage": usage_body(usage)}

    def end(self, usage: Usage) -> list[str]:
        if not self.include_usage:
            return ["data: [DONE]\n\n"]
        return [sse({**self._envelope(self.chunk_object, []), "usage": usage_body(usage)}), "data: [DONE]\n\n"]

    def error(self, exc: RequestError) -> list[str]:
        return [sse(exc.body()), "data: [DONE]\n\n"]


class ChatWriter(_OpenAIWriter):
    """One chat request's response: a role chunk per choice first, then each choice's deltas and its finish chunk."""

    prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, conv: Conversation, plan: ChatPlan, model: str) -> None:
        super().__init__(model, conv.req.include_usage)
        self.n = conv.req.n

    def _delta(self, index: int, delta: dict, finish: str | None = None) -> list[str]:
        return [self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": finish})]

    def head(self) -> list[str]:
        return [frame for i in range(self.n) for frame in self._delta(i, {"role": "assistant", "content": ""})]

    def content(self, index: int, text: str) -> list[str]:
        return self._delta(index, {"content": text})

    def reasoning(self, index: int, text: str) -> list[str]:
        return self._delta(index, {"reasoning_content": text})

    def tool_call(self, index: int, call: ToolCall) -> list[str]:
        head = {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        args = {"index": call.index, "function": {"arguments": call.arguments}}
        return self._delta(index, {"tool_calls": [head]}) + self._delta(index, {"tool_calls": [args]})

    def finish(self, index: int, finish: Finish) -> list[str]:
        return self._delta(index, {}, finish_reason(finish.reason, finish.called))

    def whole(self, choices: list[tuple[Parsed, Finish]], usage: Usage) -> dict:
        out = []
        for i, (answer, finish) in enumerate(choices):
            content = answer.content if answer.content or not answer.calls else None
            message: dict = {"role": "assistant", "content": content}
            if answer.reasoning:
                message["reasoning_content"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in answer.calls
                ]
            out.append({"index": i, "message": message, "logprobs": None,
                        "finish_reason": finish_reason(finish.reason, finish.called)})  # fmt: skip
        return self._whole(out, usage)


class CompletionWriter(_OpenAIWriter):
    """One text completion: a choice's new text and its finish reason travel in one chunk."""

    prefix, whole_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, req: CompletionRequest, model: str) -> None:
        super().__init__(model, req.include_usage)

    def output(self, index: int, events: list[Event], finish: Finish | None) -> list[str]:
        text = "".join(e.text for e in events)  # all content: the plain parser's
        if not text and finish is None:
            return []
        reason = None if finish is None else finish.reason
        return [self._chunk({"index": index, "text": text, "logprobs": None, "finish_reason": reason})]

    def whole(self, choices: list[tuple[Parsed, Finish]], usage: Usage) -> dict:
        out = [{"index": i, "text": answer.content, "logprobs": None, "finish_reason": finish.reason}
               for i, (answer, finish) in enumerate(choices)]  # fmt: skip
        return self._whole(out, usage)
