"""OpenAI's harmony format (gpt-oss) in model output, streamed: the output is a run of messages, each a header and a
body, `<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>` (the first
message's `<|start|>assistant` is the prompt's generation prompt; the last body may end in `<|return|>` or `<|call|>`,
or, where the model stops on those tokens, at the end of the output). A body on the analysis channel is reasoning;
on final, or on commentary without a recipient (a preamble), content; addressed `to=functions.NAME`, a tool call,
which goes out once its body is whole and a JSON object. Anything else (a call with tools off or arguments that are
not an object, another recipient, text that is not harmony) goes out verbatim as content.

As the other parsers (`tool_calls.py`), it decides only on the text read so far, so streamed pieces reassemble to
exactly the non-streamed answer; bodies are kept as written (no whitespace trimmed).
"""

from __future__ import annotations

import json
import re

from edgemoe.server.reasoning import Reasoning
from edgemoe.server.tool_calls import Content, ToolCall, _object, partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)  # what a message's text cannot hold
_BODY_ENDS = (END, RETURN, CALL, START)
_HEADER_MAX = 256  # characters before <|message|>: beyond, the text is not a header
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """One choice's output -> events (`Reasoning`, `Content`, `ToolCall`), as `chat_format.OutputParser`.
    `calls`: whether tool calls are read (the request has tools it lets the model call); `max_calls`: 1 when
    parallel calls are off (the output after the first call is dropped)."""

    def __init__(self, calls: bool, max_calls: int | None = None) -> None:
        self.calls, self.max_calls = calls, max_calls
        self._buf = ""
        self._state = "header"  # header (up to <|message|>), body, between (after an end marker)
        self._header = ""  # the current message's header as written, for a call that goes out as text
        self._kind, self._name = "content", ""  # the body's: reasoning, content, call or raw
        self._count = 0

    def feed(self, text: str) -> list:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list:
        return self._drain(final=True)

    def _done(self) -> bool:
        return self.max_calls is not None and self._count >= self.max_calls

    def _drain(self, final: bool) -> list:
        out: list = []
        while self._buf and not self._done():
            if self._state == "between":
                if not self._buf.startswith(START):
                    if START.startswith(self._buf) and not final:
                        return out
                    self._state, self._kind, self._header = "body", "content", ""  # not harmony: text
                    continue
                self._state = "header"
            if self._state == "header" and not self._read_header(final):
                return out
            if not self._read_body(final, out):
                return out
        if self._done():
            self._buf = ""
        return out

    def _read_header(self, final: bool) -> bool:
        """The header up to <|message|>: False while it may still come."""
        i = self._buf.find(MESSAGE)
        if i < 0 or i > _HEADER_MAX:
            if not final and len(self._buf) < _HEADER_MAX + len(MESSAGE):
                return False
            self._state, self._kind, self._header = "body", "content", ""  # not a header: text, as it is
            return True
        header = self._buf[:i]
        self._header, self._buf, self._state = header + MESSAGE, self._buf[i + len(MESSAGE) :], "body"
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        if recipient is not None:
            named = recipient[1].removeprefix("functions.")
            call = self.calls and recipient[1].startswith("functions.") and bool(named)
            self._kind, self._name = ("call" if call else "raw"), named
        else:
            self._kind = "reasoning" if channel is not None and channel[1] == "analysis" else "content"
        return True

    def _read_body(self, final: bool, out: list) -> bool:
        """The body up to its end marker: False while it may still come (a reasoning or content body goes out as it
        arrives, less what may be the start of a marker)."""
        ends = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
        at, mark = min(ends) if ends else (-1, "")
        if at < 0 and not final:
            if self._kind in ("reasoning", "content"):
                keep = max(partial_suffix(self._buf, m) for m in _BODY_ENDS)
                self._emit(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
            return False
        body = self._buf if at < 0 else self._buf[:at]
        self._buf = "" if at < 0 else self._buf[at + (0 if mark == START else len(mark)) :]
        self._state = "between"
        if self._kind in ("reasoning", "content"):
            self._emit(body, out)
            return True
        args = _object(body.strip()) if self._kind == "call" else None
        if args is None:  # not a call: the message as written
            out.append(Content(self._header + body + ("" if mark == START else mark)))
            return True
        out.append(ToolCall(self._count, self._name, json.dumps(args, ensure_ascii=False)))
        self._count += 1
        return True

    def _emit(self, text: str, out: list) -> None:
        if text:
            out.append(Reasoning(text) if self._kind == "reasoning" else Content(text))


def history_closing(calls: bool) -> tuple[str, str] | None:
    """How an answer ends in a replayed history (`replay.Turn.closing`) where a template's returned message does not
    end so: an answer that calls tools stopped on `<|call|>`, which the history keeps, where a message's text ends in
    `<|end|>` (an answer's `<|return|>` becomes `<|end|>` there, as the template writes it)."""
    return (END, CALL) if calls else None
