"""OpenAI chat completions with tool calls and reasoning: the response and its SSE chunks.

Each choice's output goes through its own `OutputParser` (`chat_format.py`); a stream sends what the parser
returns as it returns it: `content` and `reasoning_content` deltas, and per tool call one delta with its index, id
and name, then one with its arguments. `finish_reason` is `tool_calls` when a choice called a tool and stopped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from edgemoe.server.chat_format import ChatPlan, Conversation, new_call_id, parse_all
from edgemoe.server.engine_loop import RequestHandle
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, ResponseBuilder, parse_request, sse, usage
from edgemoe.server.reasoning import Reasoning
from edgemoe.server.tool_calls import Content, ToolCall


def parse(body: object) -> Conversation:
    return Conversation(parse_request(ChatCompletionRequest, body))


def finish_reason(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


class ChatBuilder(ResponseBuilder):
    """Builds one chat request's response, whole or streamed."""

    def __init__(self, conv: Conversation, plan: ChatPlan, handle: RequestHandle, model: str) -> None:
        super().__init__(True, model, conv.req.include_usage)
        self.plan, self.handle = plan, handle

    def response(self, texts: list[str], finish_reasons: list[str], usage: dict) -> dict:
        choices = []
        for i, (text, reason) in enumerate(zip(texts, finish_reasons)):
            out = parse_all(self.plan.parser(), text)
            message: dict = {"role": "assistant", "content": out.content if out.content or not out.calls else None}
            if out.reasoning:
                message["reasoning_content"] = out.reasoning
            if out.calls:
                message["tool_calls"] = [
                    {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in out.calls
                ]
            choices.append({"index": i, "message": message, "logprobs": None,
                            "finish_reason": finish_reason(reason, bool(out.calls))})  # fmt: skip
        body = self._envelope("chat.completion", choices)
        body["usage"] = usage
        return body

    def delta(self, index: int, delta: dict, finish: str | None = None) -> str:
        body = self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": None,
                                                         "finish_reason": finish}])  # fmt: skip
        if self.include_usage:  # OpenAI: with include_usage, every other chunk says usage: null
            body["usage"] = None
        return sse(body)

    async def stream(self) -> AsyncIterator[str]:
        """The SSE body: a role chunk per choice, deltas as the parsers release them, the finish chunk of each
        choice, the usage chunk if asked for, then [DONE]."""
        n = len(self.handle.params)
        parsers = [self.plan.parser() for _ in range(n)]
        called = [False] * n
        try:
            for i in range(n):
                yield self.delta(i, {"role": "assistant", "content": ""})
            async for index, out in self.handle.outputs():
                events = parsers[index].feed(out.delta) if out.delta else []
                if out.finish_reason:
                    events += parsers[index].finish()
                for e in events:
                    if isinstance(e, ToolCall):
                        called[index] = True
                        head = {"index": e.index, "id": new_call_id(), "type": "function",
                                "function": {"name": e.name, "arguments": ""}}  # fmt: skip
                        yield self.delta(index, {"tool_calls": [head]})
                        args = {"index": e.index, "function": {"arguments": e.arguments}}
                        yield self.delta(index, {"tool_calls": [args]})
                    elif isinstance(e, Reasoning):
                        yield self.delta(index, {"reasoning_content": e.text})
                    elif isinstance(e, Content):
                        yield self.delta(index, {"content": e.text})
                if out.finish_reason:
                    yield self.delta(index, {}, finish_reason(out.finish_reason, called[index]))
            if self.include_usage:
                yield self.usage_chunk(usage(*self.handle.usage()))
        except RequestError as exc:  # the status line is gone already: the error travels as an event
            yield sse(exc.body())
        yield "data: [DONE]\n\n"
