"""A conversation in, a parsed answer out: what the chat APIs (OpenAI chat completions, Anthropic messages, OpenAI
responses) share once their requests are converted to OpenAI chat messages.

- `detect_formats`, once per model: the tool-call format of its output, whether it reasons in `<think>` blocks, and
  whether its chat template renders tools (`--tool-parser` and `--reasoning-parser` override the first two).
- `render_chat`: messages and tools through the model's own chat template, with Hugging Face's conventions (tools in
  the OpenAI function format, assistant `tool_calls` with arguments as objects, `tool` messages with `tool_call_id`),
  each checked first; a `ChatPlan` then makes the output parser of each choice.
- `OutputParser`: reasoning first, tool calls in the answer; `parse_all` for a finished text.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import uuid
from dataclasses import dataclass, field

import jinja2
import jinja2.meta

from edgemoe.errors import EdgeMoEError
from edgemoe.sampling_params import SamplingParams
from edgemoe.server import constraints
from edgemoe.server.constraints import response_schema
from edgemoe.server.harmony import HarmonyParser
from edgemoe.server.prompt import Segments, encode, render, replay_marks
from edgemoe.server.protocol import ChatCompletionRequest, ChatMessage, RequestError
from edgemoe.server.reasoning import Reasoning, ReasoningParser, opens_reasoning
from edgemoe.server.replay import TurnStore
from edgemoe.server.tool_calls import TOOL_PARSERS, Content, ToolCall, ToolParser
from edgemoe.tokenizer import Tokenizer

Event = Content | Reasoning | ToolCall
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_RESERVED = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # set by the server


@dataclass(frozen=True)
class ChatFormats:
    tool_parser: str | None  # a key of TOOL_PARSERS; None: the model's tool calls are not known
    reasoning: bool  # <think>...</think>
    template_tools: bool  # the chat template renders `tools`
    mistral_v11: bool = False  # Mistral calls as NAME[ARGS]{...} (the [ARGS] token exists), else a JSON list

    def describe(self) -> str:
        reasoning = "harmony" if self.harmony else "qwen3" if self.reasoning else "none"
        return f"tool calls: {self.tool_parser or 'none'}, reasoning: {reasoning}"

    @property
    def harmony(self) -> bool:
        """gpt-oss's channels: reasoning, content and calls in one format (`harmony.py`)."""
        return self.tool_parser == "harmony"


def _template_source(tokenizer: Tokenizer) -> str:
    template = tokenizer.config.get("chat_template") or ""
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), "")
    return template


def detect_formats(tokenizer: Tokenizer, tool_parser: str = "auto", reasoning_parser: str = "auto") -> ChatFormats:
    """The model's formats from its chat template and vocabulary: harmony's template writes `<|channel|>` and
    `<|message|>`, Qwen3-Coder's `<function=` and
    `<parameter=`, GLM-4.5's `<arg_key>` and `<arg_value>`; Mistral's tokenizers have a `[TOOL_CALLS]` token; Qwen's
    and Hermes' a `<tool_call>` token (or their template mentions it); `<think>` in the template or both think tags
    as tokens: reasoning."""
    source = _template_source(tokenizer)

    def token(text: str) -> bool:
        return text in source or len(tokenizer.encode(text, add_special_tokens=False)) == 1

    if tool_parser == "auto":
        if "<|channel|>" in source and "<|message|>" in source:
            tool_parser = "harmony"
        elif "<function=" in source and "<parameter=" in source:
            tool_parser = "qwen3_coder"
        elif "<arg_key>" in source and "<arg_value>" in source:
            tool_parser = "glm"
        elif token("[TOOL_CALLS]"):
            tool_parser = "mistral"
        elif token("<tool_call>"):
            tool_parser = "qwen"
        else:
            tool_parser = "none"
    if reasoning_parser == "auto":
        reasoning_parser = "qwen3" if "<think>" in source or (token("<think>") and token("</think>")) else "none"
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        template_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateError:
        template_tools = False
    v11 = len(tokenizer.encode("[ARGS]", add_special_tokens=False)) == 1
    return ChatFormats(None if tool_parser == "none" else tool_parser, reasoning_parser == "qwen3", template_tools, v11)


class OutputParser:
    """One choice's output -> events: reasoning first, then tool calls in the answer (or harmony's messages, which
    say which each is)."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, harmony: HarmonyParser | None = None
    ) -> None:
        self.reasoning, self.tools, self.harmony = reasoning, tools, harmony

    def feed(self, text: str) -> list[Event]:
        if self.harmony:
            return _merge(self.harmony.feed(text))
        return self._route(self.reasoning.feed(text) if self.reasoning else [("content", text)])

    def finish(self) -> list[Event]:
        if self.harmony:
            return _merge(self.harmony.finish())
        out = self._route(self.reasoning.finish() if self.reasoning else [])
        return _merge(out + (self.tools.finish() if self.tools else []))

    def _route(self, pieces: list[tuple[str, str]]) -> list[Event]:
        out: list[Event] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(Reasoning(text))
            elif self.tools:
                out += self.tools.feed(text)
            else:
                out.append(Content(text))
        return _merge(out)


def _merge(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, ToolCall):
            out.append(e)
        elif not e.text:
            continue
        elif out and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, e: Event) -> None:
        if isinstance(e, ToolCall):
            self.calls.append(e)
        elif isinstance(e, Reasoning):
            self.reasoning += e.text
        else:
            self.content += e.text


def parse_all(parser: OutputParser, text: str) -> Parsed:
    out = Parsed()
    for e in parser.feed(text) + parser.finish():
        out.add(e)
    return out


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass
class Conversation:
    """A chat API's request converted: the conversation and its sampling fields as OpenAI chat, and what the other
    APIs add (their template switches, an answer's given start, a max_tokens to fit the context rather than refuse)."""

    req: ChatCompletionRequest
    template_kwargs: dict = field(default_factory=dict)
    prefill: str = ""
    fit_max_tokens: bool = False
    wire: object = None  # the API's own request, for its writer
    fields: dict = field(default_factory=dict)  # a template switch -> the API's field that set it, for errors


@dataclass
class ChatPlan:
    """A rendered conversation: the prompt, and what its output parsers need."""

    prompt_ids: list[int]
    formats: ChatFormats
    tools: list[dict]  # the request's tools, checked (empty when none)
    tool_choice: str  # none, auto, required or function
    parallel: bool = True
    in_reasoning: bool = False  # the prompt leaves the model inside <think>
    opening: str | None = None  # what the prompt ends with after the conversation (None: cannot be told)
    grammar: str | None = None  # what the answer must be (a forced call, a JSON schema): `constraints.py`

    def parser(self) -> OutputParser:
        """A fresh output parser for one choice."""
        calls = bool(self.tools) and self.tool_choice != "none"
        if self.formats.harmony:
            return OutputParser(None, None, HarmonyParser(calls, None if self.parallel else 1))
        tools = None
        if calls:
            tools = TOOL_PARSERS[self.formats.tool_parser](self.tools, None if self.parallel else 1)
        reasoning = ReasoningParser(self.in_reasoning) if self.formats.reasoning else None
        return OutputParser(reasoning, tools)

    def sampling(self, params: list[SamplingParams]) -> list[SamplingParams]:
        for p in params:
            p.grammar = self.grammar
            if self.formats.tool_parser == "mistral" and self.tools:  # its [TOOL_CALLS] token is a special one
                p.skip_special_tokens = False
            if self.formats.harmony:  # the channels' markup is special tokens
                p.skip_special_tokens = False
        return params


def render_chat(
    tokenizer: Tokenizer,
    formats: ChatFormats,
    req: ChatCompletionRequest,
    template_kwargs: dict | None = None,
    prefill: str = "",
    add_generation_prompt: bool = True,
    limit: int | None = None,
    turns: TurnStore | None = None,
    fields: dict | None = None,
) -> ChatPlan:
    """Check the conversation and render it. `template_kwargs`: switches the API sets (the request's
    chat_template_kwargs win); `prefill`: the start of the answer, given by the client (not parsed as output);
    `turns`: the answers the server gave, replayed as generated where the conversation returns them; `fields`: the
    API's names of the switches, for a template that refuses one by its name (harmony's `reasoning_effort`)."""
    tools = _tools(req.tools)
    choice, function = _tool_choice(req.tool_choice, tools)
    use_tools = bool(tools) and choice != "none"
    messages = _messages(req.messages)
    if not formats.template_tools and (use_tools or any("tool_calls" in m or m["role"] == "tool" for m in messages)):
        raise RequestError(400, "this model's chat template does not support tools", "tools", "invalid_value")
    if use_tools and formats.tool_parser is None:
        message = "the server does not know this model's tool-call format: start it with --tool-parser"
        raise RequestError(400, message, "tools", "invalid_value")
    masked, marks = replay_marks(messages, turns)  # (before Mistral's ids: the store knows the ids it gave)
    if formats.tool_parser == "mistral":
        _mistral_ids(messages)
    kwargs = {**(template_kwargs or {}), **_template_kwargs(req.chat_template_kwargs)}
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    try:
        segments, gen = render(
            tokenizer, masked, marks, messages, add_generation_prompt, tools if use_tools else None, kwargs
        )
    except EdgeMoEError as exc:
        raise _refused(str(exc), kwargs, fields or {}) from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # the template's own code failed on this data
        raise RequestError(400, f"chat template: {type(exc).__name__}: {exc}", "messages", "invalid_value") from None
    segments[-1] += prefill
    ids = _tokens(tokenizer, segments, limit)
    parallel = req.parallel_tool_calls is not False
    in_reasoning = formats.reasoning and opens_reasoning(segments[-1])
    schema = response_schema(req.response_format, "response_format")
    calls = _required_calls(choice, function, schema) if use_tools else None
    grammar = constraints.grammar(tokenizer, formats, tools, calls, schema, parallel, in_reasoning)
    if grammar is not None and prefill:
        raise RequestError(400, "a required call or format cannot follow a given start of the answer", "messages")
    opening = None if gen is None else gen + prefill
    return ChatPlan(ids, formats, tools, choice, parallel, in_reasoning, opening, grammar)


def _refused(message: str, kwargs: dict, fields: dict) -> RequestError:
    """A template's refusal as a 400: one that names its field first (`messages.2.content: ...`, a switch such as
    `reasoning_effort: ...`) names it as the request's param (a switch by the API's field that set it)."""
    m = re.match(r"chat template: ([\w.]+): ", message)
    name = m[1] if m and (m[1] in kwargs or m[1].startswith("messages.")) else None
    param = fields.get(name, name) if name else "messages"
    if name in fields:
        message = message.replace(f"{name}: ", f"{fields[name]}: ", 1)
    return RequestError(400, message, param, "invalid_value")


def _required_calls(choice: str, function: str | None, schema: dict | None) -> str | None:
    """What `constraints.grammar` takes as `calls`: a call required ("required", or the function named), or
    "auto" where a required format leaves the model free to call the tools instead; None: no constraint on calls."""
    if choice == "function":
        return function
    return choice if choice == "required" else "auto" if schema is not None else None


def _tokens(tokenizer: Tokenizer, segments: Segments, limit: int | None) -> list[int]:
    """The prompt's tokens, checked."""
    try:
        for s in segments:
            if isinstance(s, str):
                s.encode()  # a lone surrogate (valid JSON, invalid Unicode) would fail deep in the tokenizer
    except UnicodeEncodeError:
        raise RequestError(400, "the text is not valid Unicode (lone surrogate)", "messages", "invalid_value") from None
    try:  # `limit`: a conversation whose length alone proves it over the context is refused before tokenizing
        ids = encode(tokenizer, segments, limit)
    except EdgeMoEError as exc:
        raise RequestError(400, str(exc), "messages", "context_length_exceeded") from None
    if not ids:
        raise RequestError(400, "the prompt is empty", "messages", "invalid_value")
    return ids


def _bad(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(400, message, param, code)


def _tools(tools: list | None) -> list[dict]:
    out, names = [], set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f'{where}: a tool must be {{"type": "function", "function": {{...}}}}', "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function: missing (an object with name, description, parameters)", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _bad(f"{where}.function.name: must be 1-128 letters, digits, _ . or -, got {name!r}", "tools")
        if name in names:
            raise _bad(f"{where}.function.name: {name!r} is defined twice", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"{where}.function.description: must be a string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"{where}.function.parameters: must be a JSON schema object", "tools")
        names.add(name)
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict | None, tools: list[dict]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise _bad('tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}',
                   "tool_choice")  # fmt: skip
    if name not in {t["function"]["name"] for t in tools}:
        raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return "function", name


def _messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages -> the template's dicts, checked: content where it is needed, tool calls whole, and every tool
    result answering a call made before it."""
    out, calls = [], {}  # call id -> function name
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.role != "assistant" and m.content is None:
            raise _bad(f"{where}.content: missing", f"{where}.content", "missing_required_parameter")
        if m.role == "assistant":
            msg: dict = {"role": "assistant", "content": m.content or ""}
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
                calls.update((c["id"], c["function"]["name"]) for c in msg["tool_calls"])
            elif m.content is None:
                raise _bad(f"{where}: an assistant message needs content or tool_calls", f"{where}.content")
        elif m.role == "tool":
            if m.tool_call_id not in calls:
                message = f"{where}.tool_call_id: {m.tool_call_id!r} answers no tool call made before it"
                raise _bad(message, f"{where}.tool_call_id")
            msg = {"role": "tool", "tool_call_id": m.tool_call_id, "name": calls[m.tool_call_id], "content": m.content}
        else:  # chat templates know "system"; "developer" is OpenAI's newer name for it
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        out.append(msg)
    return out


def _call(call: object, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise _bad(f'{where}: a tool call must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                   where)  # fmt: skip
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise _bad(f"{where}.id: missing", f"{where}.id")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"{where}.function.name: missing", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments: must be a JSON object", f"{where}.function.arguments")
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _template_kwargs(kwargs: dict | None) -> dict:
    for key in kwargs or {}:
        if key in _RESERVED or not key.isidentifier():
            raise _bad(f"chat_template_kwargs: {key!r} cannot be set", "chat_template_kwargs")
    return dict(kwargs or {})


def _mistral_ids(messages: list[dict]) -> None:
    """Mistral's templates take only 9-character alphanumeric call ids: map the others, the same way for a call and
    its result."""

    def nine(ident: str) -> str:
        return ident if re.fullmatch(r"[A-Za-z0-9]{9}", ident) else hashlib.sha256(ident.encode()).hexdigest()[:9]

    for m in messages:
        for c in m.get("tool_calls", ()):
            c["id"] = nine(c["id"])
        if m["role"] == "tool":
            m["tool_call_id"] = nine(m["tool_call_id"])


def announce(formats: ChatFormats) -> None:
    print(f"edgemoe: chat output: {formats.describe()}", file=sys.stderr, flush=True)
