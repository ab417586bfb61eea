"""Tool calls in model output: one streaming parser per family's format.

A parser is fed the output text as the engine produces it and returns events: `Content` (text for the user) and
`ToolCall` (a complete, validated call). Streamed and non-streamed responses run the same parser (non-streamed: one
`feed` of the whole text, then `finish`), and every decision depends only on the text read so far, so the deltas of
a stream reassemble to exactly the non-streamed result wherever the text is cut.

A call goes out only once it is complete and valid, so a client never sees half a call (agents act on whole calls
anyway). Output that opens a call but is not one (bad JSON, arguments that are not an object, no name, cut off by
max_tokens) goes out verbatim as content. Whitespace between content and calls is dropped.

Formats (`edgemoe serve --tool-parser`; `auto` picks one per model, see `chat_format.detect_formats`):
- `qwen`: `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>` (Qwen2, Qwen2.5, Qwen3; Hermes)
- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
  values are typed by the tool's JSON schema (a string parameter keeps its text as it is)
- `mistral`: `[TOOL_CALLS] [{"name": NAME, "arguments": {...}}, ...]` (v3 tokenizers) or `[TOOL_CALLS]NAME[ARGS]{...}`
  (v11 and later)
- `glm`: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>` (GLM-4.5); values
  typed by the tool's JSON schema, as `qwen3_coder`'s
- `harmony`: gpt-oss's messages, calls among them; read by `harmony.HarmonyParser` with the reasoning (`chat_format`)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int  # 0, 1, ... in the order the model made them
    name: str
    arguments: str  # a JSON object
    id: str = ""  # given by the answer loop, in the request's API's form


@dataclass(frozen=True)
class _Calls:
    calls: list[tuple[str, dict]]
    end: int  # characters of the call's text consumed


@dataclass(frozen=True)
class _Malformed:
    end: int  # characters of the call's text that go out as content (after the opening marker)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _JsonScan:
    """Finds where the JSON object or array opening at `start` ends, resuming where the previous call stopped (a
    call's text only grows while it is read, and rescanning a long file's worth of arguments every token would be
    quadratic). A `<` outside a string ends it as malformed there: it is never JSON, and it is how markup such as
    `</tool_call>` begins, so an object left open does not swallow the calls after it."""

    _OUTSIDE = re.compile(r'[{}\[\]"<]')
    _INSIDE = re.compile(r'["\\]')

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.stack, self.in_string = start, start, [], False
        self.end: int | None = None

    def run(self, text: str) -> int | None:
        """The end (exclusive) once the value has closed; None while it is open; -1 if it cannot be JSON (then
        `pos` is where that became clear)."""
        while self.end is None:
            m = (self._INSIDE if self.in_string else self._OUTSIDE).search(text, self.pos)
            if m is None:
                return None
            c, self.pos = m[0], m.end()
            if self.in_string:
                if c == "\\":
                    if self.pos == len(text):  # the escaped character has not arrived yet
                        self.pos -= 1
                        return None
                    self.pos += 1
                else:
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == "<":
                self.pos, self.end = m.start(), -1
            elif c in "{[":
                self.stack.append("}" if c == "{" else "]")
            elif not self.stack or self.stack.pop() != c:
                self.end = -1
            elif not self.stack:
                self.end = self.pos
        return self.end


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON (no NaN or Infinity, which would go out as invalid JSON); None if it is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject)
    except (ValueError, RecursionError):
        return None


def _object(value: Any) -> dict | None:
    """Arguments as a dict: an object, or a string holding one (some models quote their arguments)."""
    value = _loads(value) if isinstance(value, str) else value
    return value if isinstance(value, dict) else None


def _json_call(obj: Any) -> tuple[str, dict] | None:
    """{"name": ..., "arguments": {...}} -> (name, arguments); None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = _object(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else (obj["name"].strip(), args)


class ToolParser:
    """The shared machinery: content until `start`, then the subclass's `_parse` reads the call's text."""

    start: str

    def __init__(self, tools: list[dict], max_calls: int | None = None) -> None:
        """`tools`: the request's tools (OpenAI function format); `max_calls`: 1 when parallel calls are off (the
        output after the first call is dropped)."""
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.max_calls = max_calls
        self._buf = ""  # text not yet decided on
        self._in_call = False
        self._ws = ""  # whitespace after content, held back: dropped if a call follows
        self._after_call = False  # drop whitespace until the next content
        self._count = 0
        self._reset_call()

    def _reset_call(self) -> None:
        """Per-call state of the subclass."""

    def _parse(self, text: str, final: bool) -> _Calls | _Malformed | None:
        """Read a call's text (what follows `start`): the calls and how much they took, or how much text is not a
        call, or None while it cannot be told yet (never when `final`: the output has ended)."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Content | ToolCall]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Content | ToolCall]:
        out = self._drain(final=True)
        if self._ws and not self._after_call:
            out.append(Content(self._ws))
        self._ws = ""
        return out

    def _drain(self, final: bool) -> list[Content | ToolCall]:
        out: list[Content | ToolCall] = []
        while self._buf and (self.max_calls is None or self._count < self.max_calls):
            if not self._in_call:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = 0 if final else partial_suffix(self._buf, self.start)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(self._buf[:i], out)
                self._buf, self._in_call = self._buf[i + len(self.start) :], True
            result = self._parse(self._buf, final)
            if result is None:
                return out
            self._in_call = False
            self._reset_call()
            if isinstance(result, _Malformed):
                raw, self._buf = self.start + self._buf[: result.end], self._buf[result.end :]
                self._content(raw, out)
                continue
            self._buf = self._buf[result.end :]
            self._ws, self._after_call = "", True
            for name, args in result.calls[: None if self.max_calls is None else self.max_calls - self._count]:
                out.append(ToolCall(self._count, name, json.dumps(args, ensure_ascii=False)))
                self._count += 1
        if self.max_calls is not None and self._count >= self.max_calls:
            self._buf = ""
        elif final and self._in_call:  # "": the output ended right after the opening marker
            self._in_call = False
            self._content(self.start, out)
        return out

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        kept = len(text.rstrip())
        if kept:
            out.append(Content(text[:kept]))
        self._ws = text[kept:]


def _first_non_space(text: str, i: int = 0) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class QwenToolParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def _reset_call(self) -> None:
        self._scan: _JsonScan | None = None

    def _parse(self, text: str, final: bool) -> _Calls | _Malformed | None:
        if self._scan is None:
            i = _first_non_space(text)
            if i == len(text):
                return _Malformed(i) if final else None
            if text[i] != "{":
                return _Malformed(i)
            self._scan = _JsonScan(i)
        j = self._scan.run(text)
        if j is None:
            return _Malformed(len(text)) if final else None
        if j < 0:
            return _Malformed(self._scan.pos)
        k = _first_non_space(text, j)
        if text.startswith(self.end, k):
            end = k + len(self.end)
        elif self.end.startswith(text[k:]):  # the end marker, in part or not yet
            if not final:
                return None
            end = len(text)  # the output ended after a whole object: a whole call, its end marker missing
        else:
            return _Malformed(j)
        call = _json_call(_loads(text[self._scan.start : j]))
        return _Calls([call], end) if call else _Malformed(end)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


class _ClosedCallParser(ToolParser):
    """A call runs from `<tool_call>` to the first `</tool_call>` (so its text cannot contain that); the format's own
    `_body_call` reads the body -> (name, arguments), or None (malformed: the text goes out as it was)."""

    start, end = "<tool_call>", "</tool_call>"

    def _reset_call(self) -> None:
        self._searched = 0

    def _parse(self, text: str, final: bool) -> _Calls | _Malformed | None:
        i = text.find(self.end, self._searched)
        if i < 0 and not final:
            self._searched = max(0, len(text) - len(self.end) + 1)
            return None
        body, end = (text, len(text)) if i < 0 else (text[:i], i + len(self.end))
        call = self._body_call(body)
        return _Calls([call], end) if call else _Malformed(end)

    def _body_call(self, body: str) -> tuple[str, dict] | None:
        raise NotImplementedError


class Qwen3CoderToolParser(_ClosedCallParser):
    """A call ends at the first `</tool_call>` (so a value cannot contain that text); inside it a value ends at the
    first `</parameter>` followed by the next parameter or `</function>`, so values may contain `</parameter>`."""

    def _body_call(self, body: str) -> tuple[str, dict] | None:
        m = _FUNCTION.match(body)
        if m is None or not m[1].strip():
            return None
        name, pos, args = m[1].strip(), m.end(), {}
        schema = self.schemas.get(name, {}).get("properties")
        schema = schema if isinstance(schema, dict) else {}
        while True:
            pos = _first_non_space(body, pos)
            if body.startswith("</function>", pos):
                return (name, args) if not body[pos + len("</function>") :].strip() else None
            p = _PARAMETER.match(body, pos)
            if p is None:
                return None
            close = p.end()
            while True:  # the value's end: a </parameter> that the next parameter or </function> follows
                close = body.find("</parameter>", close)
                if close < 0:
                    return None
                pos = close + len("</parameter>")
                after = _first_non_space(body, pos)
                if body.startswith("<parameter=", after) or body.startswith("</function>", after):
                    break
                close += 1
            value = body[p.end() : close]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p[1].strip()] = _typed(value, schema.get(p[1].strip()))


def _types(prop: Any) -> list[str]:
    """The JSON-schema types a parameter allows (`type`, a list of them, or `anyOf`)."""
    if not isinstance(prop, dict):
        return []
    kind = prop.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return [t for option in prop.get("anyOf", []) for t in _types(option)]


def _typed(value: str, prop: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type; text that does not fit the type stays text."""
    types = _types(prop)
    if not types or "string" in types:
        return value
    text = value.strip()
    if text.lower() in ("null", "none") and "null" in types:
        return None
    for kind in types:
        if kind == "integer" and re.fullmatch(r"-?\d+", text):
            return int(text)
        if kind == "number":
            number = _loads(text)
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                return number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            parsed = _loads(text)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return value


_NAME = re.compile(r"[\w.\-]+")
_CALL_ID, _ARGS = "[CALL_ID]", "[ARGS]"


class MistralToolParser(ToolParser):
    """No end marker: a call ends where its JSON closes. Several calls: one JSON list (v3) or one `[TOOL_CALLS]`
    per call (v11)."""

    start = "[TOOL_CALLS]"

    def _reset_call(self) -> None:
        self._scan: _JsonScan | None = None
        self._name: str | None = None

    def _parse(self, text: str, final: bool) -> _Calls | _Malformed | None:
        if self._scan is None:
            i = _first_non_space(text)
            if i == len(text):
                return _Malformed(i) if final else None
            if text[i] not in "[{":
                found = self._header(text, i)  # NAME[ARGS] or NAME[CALL_ID]ID[ARGS]
                if not isinstance(found, int):
                    return _Malformed(len(text)) if final and found is None else found
                i = found
                if i == len(text):
                    return _Malformed(i) if final else None
                if text[i] != "{":
                    return _Malformed(i)
            self._scan = _JsonScan(i)
        j = self._scan.run(text)
        if j is None:
            return _Malformed(len(text)) if final else None
        if j < 0:
            return _Malformed(self._scan.pos)
        value = _loads(text[self._scan.start : j])
        if self._name is not None:
            args = _object(value)
            calls = None if args is None else [(self._name, args)]
        else:
            items = value if isinstance(value, list) else [value]
            calls = [_json_call(item) for item in items]
            calls = calls if calls and all(calls) else None
        return _Calls(calls, j) if calls else _Malformed(j)

    def _header(self, text: str, i: int) -> int | _Malformed | None:
        """Where the arguments of `NAME[ARGS]` start; None while the header may still come; malformed otherwise."""
        m = _NAME.match(text, i)
        if m is None:
            return _Malformed(i)
        pos = m.end()
        if text.startswith(_CALL_ID, pos):
            ident = _NAME.match(text, pos + len(_CALL_ID))
            pos = ident.end() if ident else pos + len(_CALL_ID)
        elif _CALL_ID.startswith(text[pos:]):
            return None
        if text.startswith(_ARGS, pos):
            self._name = m[0]
            return pos + len(_ARGS)
        return None if _ARGS.startswith(text[pos:]) else _Malformed(pos)


_GLM_NAME = re.compile(r"\s*([\w.\-]+)\s*")
_ARG_KEY = re.compile(r"<arg_key>([^<\n]+)</arg_key>\s*<arg_value>")


class GlmToolParser(_ClosedCallParser):
    """A call ends at the first `</tool_call>` (so a value cannot contain that text); inside it a value ends at the
    first `</arg_value>` followed by the next `<arg_key>` or the call's end, so values may contain `</arg_value>`."""

    def _body_call(self, body: str) -> tuple[str, dict] | None:
        m = _GLM_NAME.match(body)
        if m is None:
            return None
        name, pos, args = m[1], m.end(), {}
        schema = self.schemas.get(name, {}).get("properties")
        schema = schema if isinstance(schema, dict) else {}
        while pos < len(body):
            k = _ARG_KEY.match(body, pos)
            if k is None:
                return None
            close = k.end()
            while True:  # the value's end: an </arg_value> that the next <arg_key> or the call's end follows
                close = body.find("</arg_value>", close)
                if close < 0:
                    return None
                pos = _first_non_space(body, close + len("</arg_value>"))
                if pos == len(body) or body.startswith("<arg_key>", pos):
                    break
                close += 1
            key = k[1].strip()
            args[key] = _typed(body[k.end() : close], schema.get(key))
        return name, args


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen": QwenToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "mistral": MistralToolParser,
    "glm": GlmToolParser,
}
