"""One answer loop for every API: a request's outputs from the engine, parsed per choice (reasoning, content, tool
calls), and written by the request's API, streamed or whole.

What differs between the APIs (OpenAI chat and text completions, Anthropic Messages, OpenAI Responses) is only how
they write: a `Writer` per API turns the loop's calls into that API's events, usage fields and error shape, so a fix
to the loop lands once for all of them. The usage is one `Usage`, which each writer renders its own way.

A stream's calls, in order: `head` once the request is admitted (its frames go out at once; an SSE comment if it
has none, so that a long prefill never leaves a client without a first byte); `begin` with the first output (the
prefix cache's share of the prompt is known by then: an API whose first event reports it waits for this); `output`
per engine output (the parser's events, and the choice's `Finish` when it ends); `end` once every choice has
finished, or `error` if the engine fails the request after the status line has gone out (after `begin`, with
nothing cached, if no output came: an API's first event always goes first).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from edgemoe.engine.sequence import RequestOutput
from edgemoe.server.chat_format import Event, OutputParser, Parsed, new_call_id, parse_all
from edgemoe.server.engine_loop import EngineLoop, RequestHandle
from edgemoe.server.protocol import RequestError
from edgemoe.server.reasoning import Reasoning
from edgemoe.server.tool_calls import ToolCall

# An SSE comment: every client skips it, while a client's first-byte and idle timers see bytes. A stream sends one at
# once when its API's first event must wait (Anthropic's message_start carries the cached share of the prompt, known
# only once the prefill has run), and one every KEEPALIVE_S while no output comes.
KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_S = 10.0


@dataclass(frozen=True)
class Usage:
    """A request's tokens: its prompt (`cached_tokens` of them read from the prefix cache) and its output (all
    choices)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finish:
    """How a choice ended: the engine's reason ("stop", "length", "abort"), what stopped it (a stop string, a stop
    token id; None: EOS), and whether it called a tool."""

    reason: str
    stop: str | int | None
    called: bool


class Writer:
    """One API's way of writing an answer (the module docstring says when each method is called). Each returns the
    SSE frames to send; `whole` returns the non-streamed body. The loop gives each tool call its id, `call_prefix`
    and a random part."""

    call_prefix = "call_"

    def head(self) -> list[str]:
        return []

    def begin(self, usage: Usage) -> list[str]:
        """`usage`: the prompt's tokens (the prefix cache's share known); no output yet."""
        return []

    def output(self, index: int, events: list[Event], finish: Finish | None) -> list[str]:
        """One engine output of choice `index`; a writer that does not override this writes each event by its
        kind."""
        frames: list[str] = []
        for e in events:
            if isinstance(e, ToolCall):
                frames += self.tool_call(index, e)
            elif isinstance(e, Reasoning):
                frames += self.reasoning(index, e.text)
            else:
                frames += self.content(index, e.text)
        if finish is not None:
            frames += self.finish(index, finish)
        return frames

    def content(self, index: int, text: str) -> list[str]:
        raise NotImplementedError

    def reasoning(self, index: int, text: str) -> list[str]:
        raise NotImplementedError

    def tool_call(self, index: int, call: ToolCall) -> list[str]:
        raise NotImplementedError

    def finish(self, index: int, finish: Finish) -> list[str]:
        raise NotImplementedError

    def end(self, usage: Usage) -> list[str]:
        raise NotImplementedError

    def error(self, exc: RequestError) -> list[str]:
        raise NotImplementedError

    def whole(self, choices: list[tuple[Parsed, Finish]], usage: Usage) -> dict:
        raise NotImplementedError


OnAnswer = Callable[[Parsed, RequestOutput], None]  # a finished choice: its parsed answer and the engine's output


def plain_parser() -> OutputParser:
    """Text completions: the output is all content."""
    return OutputParser(None, None)


def usage(handle: RequestHandle) -> Usage:
    """A finished request's usage. Its choices share the prompt; the cached share is the largest any choice got."""
    done = [f for f in handle.finals if f is not None]
    completion = sum(len(f.token_ids) for f in done)
    return Usage(len(handle.prompt_ids), completion, max((f.cached_tokens for f in done), default=0))


async def answer(
    request: Request,
    handle: RequestHandle,
    engine_loop: EngineLoop,
    writer: Writer,
    parser: Callable[[], OutputParser],
    stream: bool,
    on_answer: OnAnswer | None = None,
) -> Response:
    """The response to an admitted request: its event stream, or its whole answer once every choice has finished.
    `parser` makes one choice's output parser; `on_answer` hears of each choice's answer once it has finished."""
    if stream:
        return _EventStream(_stream(handle, writer, parser, on_answer), handle, engine_loop)
    await _finish(request, handle, engine_loop)
    choices = []
    for final in handle.finals:
        out = parse_all(parser(), final.text)
        out.calls = [_named(c, writer) for c in out.calls]
        if on_answer is not None:
            on_answer(out, final)
        choices.append((out, Finish(final.finish_reason, final.stop_reason, bool(out.calls))))
    return JSONResponse(writer.whole(choices, usage(handle)))


def _named(call: ToolCall, writer: Writer) -> ToolCall:
    return dataclasses.replace(call, id=new_call_id(writer.call_prefix))


async def _stream(
    handle: RequestHandle, writer: Writer, parser: Callable[[], OutputParser], on_answer: OnAnswer | None
) -> AsyncIterator[str]:
    parsers = [parser() for _ in handle.params]
    answers = [Parsed() for _ in handle.params]
    called = [False] * len(parsers)
    begun = False
    for frame in writer.head() or [KEEPALIVE]:  # bytes at once, whatever the API's first event waits for
        yield frame
    try:
        async for item in _paced(handle.outputs(), KEEPALIVE_S):
            if item is None:
                yield KEEPALIVE
                continue
            index, out = item
            if not begun:
                begun = True
                for frame in writer.begin(Usage(len(handle.prompt_ids), 0, out.cached_tokens)):
                    yield frame
            events = parsers[index].feed(out.delta) if out.delta else []
            if out.finish_reason:
                events += parsers[index].finish()
            events = [_named(e, writer) if isinstance(e, ToolCall) else e for e in events]
            for e in events:
                answers[index].add(e)
            if out.finish_reason and on_answer is not None:
                on_answer(answers[index], out)
            called[index] |= any(isinstance(e, ToolCall) for e in events)
            finish = Finish(out.finish_reason, out.stop_reason, called[index]) if out.finish_reason else None
            for frame in writer.output(index, events, finish):
                yield frame
        frames = writer.end(usage(handle))
    except RequestError as exc:  # the status line is gone already: the error travels as an event
        frames = [] if begun else writer.begin(Usage(len(handle.prompt_ids), 0))  # (before any output: nothing cached)
        frames += writer.error(exc)
    for frame in frames:
        yield frame


async def _paced(items: AsyncIterator, period: float) -> AsyncIterator:
    """`items`, and None each time `period` seconds pass without one (a long prefill, a queue)."""
    it = items.__aiter__()
    while True:
        step = asyncio.ensure_future(it.__anext__())
        try:
            while not (await asyncio.wait({step}, timeout=period))[0]:
                yield None
        finally:
            if not step.done():  # the response was cancelled (the client left)
                step.cancel()
        try:
            item = step.result()
        except StopAsyncIteration:
            return
        yield item


class _EventStream(StreamingResponse):
    """When the client goes away, Starlette cancels the response; then the sequences are aborted. Done here
    rather than in the body generator, whose `finally` never runs if it is cancelled before its first chunk."""

    def __init__(self, body: AsyncIterator[str], handle: RequestHandle, engine_loop: EngineLoop) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.handle, self.engine_loop = handle, engine_loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.handle.done:
                self.engine_loop.abort(self.handle)


async def _finish(request: Request, handle: RequestHandle, engine_loop: EngineLoop) -> None:
    """Wait for every choice, or for the client to leave (then abort: nobody will read the answer)."""

    async def finish() -> None:
        async for _ in handle.outputs():
            pass

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(finish()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        if not handle.done:
            engine_loop.abort(handle)
    if not work.done() or work.cancelled():
        raise RequestError(499, "the client disconnected", code="client_disconnected")
    work.result()  # raises the engine loop's error, if any
