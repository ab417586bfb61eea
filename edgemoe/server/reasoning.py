"""Reasoning in model output: Qwen3-style `<think>...</think>` split from the answer, streamed.

Like the tool-call parsers (`tool_calls.py`), the parser is fed text as it is produced and decides only on the text
read so far, so streamed pieces reassemble to exactly the non-streamed split. Whitespace around the reasoning (the
template's newlines after `<think>` and before and after `</think>`) belongs to neither part.

The output is reasoning from its start when the rendered prompt ends inside `<think>` (thinking models whose
template opens the block, e.g. Qwen3-2507 Thinking), or when the output opens with `<think>`; otherwise it is all
answer. A reasoning that the output never closes (cut off by max_tokens) stays reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgemoe.server.tool_calls import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    text: str


def opens_reasoning(prompt: str) -> bool:
    """Does the rendered prompt leave the model inside a `<think>` block?"""
    return prompt.rstrip().endswith(OPEN)


class ReasoningParser:
    """Splits output into ("reasoning", text) and ("content", text) pieces."""

    def __init__(self, in_reasoning: bool) -> None:
        # start: <think> may still open the output; reasoning; answer: after </think>, before its first non-space
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""
        self._lead = True  # the reasoning's leading whitespace is dropped
        self._ws = ""  # the reasoning's trailing whitespace, held back: dropped if </think> follows

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self._state, self._buf = "reasoning", head[len(OPEN) :]
            elif OPEN.startswith(head) and not final:
                return out
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buf.find(CLOSE)
            if end < 0:
                keep = 0 if final else partial_suffix(self._buf, CLOSE)
                self._reasoning(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            self._reasoning(self._buf[:end], out)
            self._state, self._buf, self._ws = "answer", self._buf[end + len(CLOSE) :], ""
        if self._state == "answer":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._state = "content"
        if self._buf:
            out.append(("content", self._buf))
            self._buf = ""
        return out

    def _reasoning(self, text: str, out: list[tuple[str, str]]) -> None:
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        text = self._ws + text
        kept = len(text.rstrip())
        if kept:
            out.append(("reasoning", text[:kept]))
        self._ws = text[kept:]
