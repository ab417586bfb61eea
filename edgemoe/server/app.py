"""The HTTP app: OpenAI and Anthropic routes over the engine loop, behind the API-key guard and the error handlers of
`edgemoe.server.http`, which turn every malformed request into a 4xx error body: OpenAI's (`{"error": {"message",
"type", "param", "code"}}`), or Anthropic's on /v1/messages (`{"type": "error", "error": {"type", "message"}}`).

The three chat APIs (chat completions, messages, responses) share one path, `_chat`: the request converted to OpenAI
chat messages, rendered by the model's chat template (`chat_format.py`). Every API's answer, text completions' too,
then goes through one answer loop (`answer.py`): its output parsed into reasoning, content and tool calls, and
written in the request's API by that API's writer (`openai_chat.py`, `anthropic.py`, `responses_writer.py`).

Bodies are read and parsed here rather than by FastAPI so that each failure has its own status: 415 for
a wrong content type, 413 for an oversized body (checked while reading, not after), 400 for bad JSON.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from edgemoe.engine.engine import LLMEngine
from edgemoe.engine.sequence import RequestOutput
from edgemoe.errors import EdgeMoEError
from edgemoe.sampling_params import SamplingParams
from edgemoe.server import anthropic, openai_chat, responses, responses_writer, tokens
from edgemoe.server.answer import OnAnswer, Writer, answer, plain_parser
from edgemoe.server.chat_format import (
    ChatFormats,
    ChatPlan,
    Conversation,
    Parsed,
    announce,
    detect_formats,
    render_chat,
)
from edgemoe.server.engine_loop import EngineLoop, RequestHandle
from edgemoe.server.harmony import history_closing
from edgemoe.server.http import ApiKeyGuard, add_error_handlers
from edgemoe.server.metrics import CONTENT_TYPE, Metrics
from edgemoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    error_body,
    parse_request,
)
from edgemoe.server.replay import TurnStore


@dataclass(frozen=True)
class ServerConfig:
    model_id: str  # what /v1/models lists and requests must name
    model_aliases: frozenset[str] = frozenset()  # other names accepted in requests (the --model path)
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    tool_parser: str = "auto"  # ServeConfig's
    reasoning_parser: str = "auto"
    default_max_tokens: int | None = None  # a request without max_tokens: this cap, or (None) the end of the context
    replay_tokens: int = 1 << 22  # the answers kept to be replayed as generated (replay.TurnStore): tokens in all,
    replay_seconds: float = 3600.0  # and for how long each


@dataclass
class _State:
    engine_loop: EngineLoop
    config: ServerConfig
    names: set[str]
    turns: TurnStore  # the answers given, replayed as generated when a conversation returns them
    formats: ChatFormats | None = None  # the model's output formats, detected at the first chat request

    def chat_formats(self, engine: LLMEngine) -> ChatFormats:
        if self.formats is None:
            self.formats = detect_formats(engine.tokenizer, self.config.tool_parser, self.config.reasoning_parser)
            announce(self.formats)
        return self.formats


def create_app(engine_loop: EngineLoop, metrics: Metrics, config: ServerConfig) -> FastAPI:
    turns = TurnStore(config.replay_tokens, config.replay_seconds)
    state = _State(engine_loop, config, {config.model_id, *config.model_aliases}, turns)
    app = FastAPI(title="edgemoe", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app, metrics)
    app.add_middleware(ApiKeyGuard, api_key=config.api_key, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        if engine_loop.ready:
            return JSONResponse({"status": "ok"})
        status = "stopping" if engine_loop.engine is not None else "loading"
        return JSONResponse(error_body(f"the server is {status}", "server_error", code=status), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(config.model_id)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        _check_model(model, state.names)
        return _model_card(config.model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat(request, state, openai_chat.parse, openai_chat.ChatWriter)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _chat(request, state, anthropic.parse, anthropic.MessagesWriter)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await _chat(request, state, responses.parse, responses_writer.ResponsesWriter)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, state)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        conv = anthropic.parse(await _read_json(request, config.max_body_bytes), count_only=True)
        _check_model(conv.req.model, state.names)
        engine = _loaded(engine_loop)
        plan = await run_in_threadpool(  # the messages route's size check: a long body must not stall the server
            render_chat,
            engine.tokenizer,
            state.chat_formats(engine),
            conv.req,
            conv.template_kwargs,
            conv.prefill,
            limit=engine.max_model_len,
            turns=state.turns,  # the count of the prompt /v1/messages runs
        )
        return {"input_tokens": len(plan.prompt_ids)}

    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _read_json(request, config.max_body_bytes)
        req = parse_request(tokens.TokenizeRequest, body)
        _check_model(req.model, state.names)
        engine = _loaded(engine_loop)
        return await run_in_threadpool(tokens.tokenize, engine, state.chat_formats(engine), body, req, state.turns)

    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict:
        req = parse_request(tokens.DetokenizeRequest, await _read_json(request, config.max_body_bytes))
        _check_model(req.model, state.names)
        return tokens.detokenize(_loaded(engine_loop), req)

    return app


def _model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "edgemoe"}


def _check_model(model: str | None, names: set[str]) -> None:
    if model is not None and model not in names:
        raise RequestError(
            404,
            f"the model {model!r} does not exist; this server serves {sorted(names)[0]!r}",
            param="model",
            code="model_not_found",
        )


def _loaded(engine_loop: EngineLoop) -> LLMEngine:
    if engine_loop.engine is None:
        raise RequestError(
            503, "the model is still loading", code="unavailable", type="server_error", headers={"Retry-After": "1"}
        )
    return engine_loop.engine


def _limit(engine: LLMEngine) -> tuple[int, str]:
    """The longest sequence a request may make, and what sets it: the context, or the KV cache if it holds less."""
    kv_tokens = engine.kv.num_blocks * engine.kv.block_size
    if engine.max_model_len <= kv_tokens:
        return engine.max_model_len, "the context limit"
    return kv_tokens, "what the KV cache holds"


async def _submit(handle: RequestHandle, engine_loop: EngineLoop) -> None:
    engine_loop.submit(handle)
    try:
        await handle.accepted  # the engine's own checks (KV room) fail here, before any byte is sent
    except asyncio.CancelledError:
        engine_loop.abort(handle)
        raise


async def _complete(request: Request, state: _State) -> Response:
    engine_loop = state.engine_loop
    body = await _read_json(request, state.config.max_body_bytes)
    req = parse_request(CompletionRequest, body)
    _check_model(req.model, state.names)
    engine = _loaded(engine_loop)
    prompt_ids = await run_in_threadpool(_tokenize, engine, req)  # a long prompt must not stall the event loop
    params = _sampling_params(req, len(prompt_ids), _limit(engine), state.config.default_max_tokens)
    handle = RequestHandle(prompt_ids, params)
    await _submit(handle, engine_loop)
    writer = openai_chat.CompletionWriter(req, state.config.model_id)
    return await answer(request, handle, engine_loop, writer, plain_parser, req.stream)


async def _chat(
    request: Request, state: _State, parse: Callable[[object], Conversation], writer: Callable[..., Writer]
) -> Response:
    """A chat API's request: `parse` converts it; `writer(conversation, plan, model)` writes the answer."""
    engine_loop = state.engine_loop
    conv = parse(await _read_json(request, state.config.max_body_bytes))
    req = conv.req
    _check_model(req.model, state.names)
    engine = _loaded(engine_loop)
    plan = await run_in_threadpool(  # a long conversation must not stall the event loop
        render_chat,
        engine.tokenizer,
        state.chat_formats(engine),
        req,
        conv.template_kwargs,
        conv.prefill,
        limit=engine.max_model_len,
        turns=state.turns,
        fields=conv.fields,
    )
    room = engine.max_model_len - len(plan.prompt_ids)
    if conv.fit_max_tokens and req.max_tokens is not None and room > 0:
        req.max_tokens = min(req.max_tokens, room)
    params = _sampling_params(req, len(plan.prompt_ids), _limit(engine), state.config.default_max_tokens)
    handle = RequestHandle(plan.prompt_ids, plan.sampling(params))
    await _submit(handle, engine_loop)
    out = writer(conv, plan, state.config.model_id)
    return await answer(request, handle, engine_loop, out, plan.parser, req.stream, _remember(state.turns, plan))


def _remember(turns: TurnStore, plan: ChatPlan) -> OnAnswer | None:
    """Where each answer goes once given: into the store, to be replayed as generated (if the prompt's end, which
    the answer continues, is known)."""
    if plan.opening is None:
        return None

    def remember(parsed: Parsed, output: RequestOutput) -> None:
        calls = [(c.id, c.name, c.arguments) for c in parsed.calls]
        closing = history_closing(bool(calls)) if plan.formats.harmony else None
        turns.remember(parsed.reasoning, parsed.content, calls, output, plan.opening, closing)

    return remember


async def _read_json(request: Request, limit: int) -> object:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise RequestError(
            415, f"Content-Type must be application/json, got {media or 'none'!r}", code="unsupported_media_type"
        )
    too_big = RequestError(413, f"the request body is larger than {limit} bytes", code="payload_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError covers bad UTF-8 and giant integers
        message = exc.args[0] if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise RequestError(400, f"the request body is not valid JSON: {message}", code="invalid_json") from None


def _tokenize(engine: LLMEngine, req: CompletionRequest) -> list[int]:
    """Prompt ids, checked: runs in a worker thread (tokenizers are thread-safe) so that a long prompt does not
    stall the event loop, and so that the engine thread only sees valid ids."""
    tok = engine.tokenizer
    param = "prompt"
    try:  # EdgeMoEError: a lone surrogate (valid JSON, invalid Unicode), a prompt whose length proves it too long
        if isinstance(req.prompt, str):
            ids = tok.encode(req.prompt, limit=engine.max_model_len)
        else:
            ids = req.prompt
            vocab = engine.model_config.vocab_size
            if max(ids) >= vocab:
                raise RequestError(400, f"token ids must be below the vocabulary size {vocab}", param, "invalid_value")
    except EdgeMoEError as exc:
        raise RequestError(400, str(exc), param, "invalid_value") from None
    if not ids:
        raise RequestError(400, "the prompt is empty", param, "invalid_value")
    return ids


def _sampling_params(
    req: ChatCompletionRequest | CompletionRequest, prompt_len: int, limit: tuple[int, str], default: int | None
) -> list[SamplingParams]:
    """One SamplingParams per choice. Without max_tokens a request may generate up to the end of the context (as
    OpenAI's API does: an agent's long answer is not cut), or `default` tokens if that is less; an explicit max_tokens
    that does not fit is an error, not truncated. `limit`: the longest sequence and what sets it (`_limit`)."""
    param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    limit, what = limit
    if prompt_len >= limit:
        raise RequestError(
            400, f"the prompt has {prompt_len} tokens; {what} is {limit}", param, "context_length_exceeded"
        )
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = limit - prompt_len if default is None else min(default, limit - prompt_len)
    elif prompt_len + max_tokens > limit:
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise RequestError(
            400,
            f"the prompt ({prompt_len} tokens) plus {name} ({max_tokens}) exceeds {what}, {limit} tokens",
            name,
            "context_length_exceeded",
        )
    base = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        stop=list(req.stop or ()),
        ignore_eos=req.ignore_eos,
    )
    try:
        return [SamplingParams(**base, seed=None if req.seed is None else req.seed + i) for i in range(req.n)]
    except EdgeMoEError as exc:
        raise RequestError(400, str(exc), code="invalid_value") from None
