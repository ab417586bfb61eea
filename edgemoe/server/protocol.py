"""The OpenAI wire format: request models (strict pydantic) and error bodies (the answers' writers: `openai_chat.py`).

Requests are validated strictly (no "1" for 1, no true for 1, no NaN) so that a client's mistake comes
back as a 400 naming the field instead of being silently coerced. Fields we do not implement but that
change the meaning of a request (logprobs, penalties, ...) are rejected when set to anything but
their no-op value; harmless ones (user, metadata, ...) are ignored.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


def _no(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == "none"


# field -> is this value a no-op we can accept without implementing the feature?
_UNSUPPORTED = {
    "functions": _no,
    "function_call": _no,
    "logprobs": _no,
    "top_logprobs": _no,
    "logit_bias": _no,
    "presence_penalty": _no,
    "frequency_penalty": _no,
    "echo": _no,
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "audio": _no,
    "modalities": lambda v: v in (None, ["text"]),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: fixed-length outputs for benchmarks

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else v or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops

    @model_validator(mode="after")
    def _unsupported(self) -> _Request:
        for name, value in (self.model_extra or {}).items():
            ok = _UNSUPPORTED.get(name)
            if ok is not None and not ok(value):
                raise _FieldError(name, f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # None: an assistant message with tool_calls (chat_format checks the rest)
    name: str | None = None
    tool_calls: list | None = None  # assistant: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # tool: the call it answers
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that show it again

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """OpenAI allows content as a list of parts; we take text parts and join them."""
        if isinstance(v, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError('content parts must be {"type": "text", "text": "..."} (only text is supported)')
            return "".join(p["text"] for p in v)
        return v


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None  # [{"type": "function", "function": {...}}], checked by chat_format
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # the template's own switches, e.g. {"enable_thinking": false}
    response_format: dict | None = None  # text, json_object or json_schema (`constraints.py`)
    reasoning_effort: str | None = None  # the template's `reasoning_effort` (harmony's low, medium or high)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """A string or token ids; a batch is accepted only when it holds exactly one prompt."""
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
                raise ValueError("token ids must be integers >= 0")
        return v


class _FieldError(ValueError):
    """A model-level check that knows which field is at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class RequestError(Exception):
    """Becomes an OpenAI error response: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_request(model: type[_Request], body: Any) -> _Request:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, _FieldError):
            raise RequestError(400, cause.message, cause.param, "invalid_value") from None
        loc, names = list(err["loc"]), _FIELD_NAMES | _field_names(model)
        tag = next((i for i, p in enumerate(loc) if i and isinstance(p, str) and p not in names), None)
        if tag is not None:  # a union member's tag ("str", "list[int]"): pydantic's path, not the client's
            loc = loc[:tag]
        param = ".".join(str(p) for p in loc) or None
        message = err["msg"].removeprefix("Value error, ")
        if tag is not None and loc and loc[-1] in _EXPECTED:
            message = f"must be {_EXPECTED[loc[-1]]}"
        elif err["type"] == "model_type":  # "a valid dictionary or instance of ChatMessage": our class's name
            message = f"must be a JSON object{_EXAMPLE.get(loc[0], '') if len(loc) > 1 else ''}"
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
        raise RequestError(400, f"{param}: {message}" if param else message, param, code) from None


_MODELS = (ChatCompletionRequest, CompletionRequest, ChatMessage, StreamOptions)
_FIELD_NAMES = {name for m in _MODELS for name in m.model_fields}


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """The field names of `model` and of the models its fields hold (their aliases too): the client's path parts."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.update({name, info.alias} - {None})
        for arg in typing.get_args(info.annotation) or (info.annotation,):
            for inner in typing.get_args(arg) or (arg,):
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner is not model:
                    names |= _field_names(inner)
    return frozenset(names)


_EXPECTED = {  # what a field of several types takes
    "stop": "a string or a list of strings",
    "prompt": "a string or a list of token ids (integers >= 0)",
}
_EXAMPLE = {"messages": ' like {"role": "user", "content": "Hello"}'}
