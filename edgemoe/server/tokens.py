"""`POST /v1/tokenize` and `/v1/detokenize` (vLLM's shapes): text or a chat conversation -> token ids, and back.

A conversation is rendered exactly as a chat completion would render it (tools, `chat_template_kwargs`), so a client
can count or inspect its prompt; `add_generation_prompt: false` renders the conversation alone.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from edgemoe.engine.engine import LLMEngine
from edgemoe.errors import EdgeMoEError
from edgemoe.server.chat_format import ChatFormats, render_chat
from edgemoe.server.protocol import ChatCompletionRequest, RequestError, parse_request
from edgemoe.server.replay import TurnStore


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # a conversation's fields are checked as a chat request's

    model: str | None = None
    prompt: str | None = None
    messages: list | None = None
    add_special_tokens: bool = True  # prompt only: the tokenizer's BOS/EOS (a chat template writes its own)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def tokenize(
    engine: LLMEngine, formats: ChatFormats, body: dict, req: TokenizeRequest, turns: TurnStore | None = None
) -> dict:
    """Runs in a worker thread (a long conversation must not stall the event loop), with the generation routes'
    size check: a text whose length alone proves it longer than the context is refused before it is tokenized."""
    tok = engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise RequestError(400, "give either prompt or messages", "prompt", "invalid_value")
    if req.prompt is not None:
        try:
            req.prompt.encode()  # a lone surrogate would fail deep in the tokenizer
        except UnicodeEncodeError:
            message = "the text is not valid Unicode (lone surrogate)"
            raise RequestError(400, message, "prompt", "invalid_value") from None
        try:  # refused before tokenizing where its length alone proves it too long, as the generation routes do
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens, limit=engine.max_model_len)
        except EdgeMoEError as exc:
            raise RequestError(400, str(exc), "prompt", "context_length_exceeded") from None
    else:
        extra = ("add_special_tokens", "add_generation_prompt", "return_token_strs")
        chat = parse_request(ChatCompletionRequest, {k: v for k, v in body.items() if k not in extra})
        plan = render_chat(
            tok, formats, chat, add_generation_prompt=req.add_generation_prompt, limit=engine.max_model_len, turns=turns
        )
        ids = plan.prompt_ids
    out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [tok.decode([i], skip_special_tokens=False) for i in ids]
    return out


def detokenize(engine: LLMEngine, req: DetokenizeRequest) -> dict:
    vocab = engine.model_config.vocab_size
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise RequestError(400, f"token ids must be in [0, {vocab})", "tokens", "invalid_value")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
