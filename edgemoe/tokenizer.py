"""Tokenizer (Hugging Face `tokenizers`), chat template (jinja2) and incremental detokenisation."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from edgemoe.errors import EdgeMoEError


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise EdgeMoEError(f"{folder} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise EdgeMoEError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
        cfg_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EdgeMoEError(f"malformed {cfg_path}: {exc}") from None
        if not isinstance(config, dict):
            raise EdgeMoEError(f"malformed {cfg_path}: expected a JSON object")
        self._setup(config)

    @classmethod
    def from_json(cls, text: str, config: dict, source: str) -> Tokenizer:
        """A tokenizer from a `tokenizer.json` document and its `tokenizer_config.json` fields (what a GGUF file's
        metadata becomes: `edgemoe.models.gguf.GGUFCheckpoint.tokenizer`); `source` names them in errors."""
        tokenizer = cls.__new__(cls)
        try:
            tokenizer._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise EdgeMoEError(f"{source}: cannot build its tokenizer: {str(exc).splitlines()[0]}") from None
        tokenizer._setup(config)
        return tokenizer

    def _setup(self, config: dict) -> None:
        self.config = config
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None  # a template that does not compile fails chat requests, not the load
        if template:
            try:
                self._template = _compile(template)
            except (jinja2.TemplateError, TypeError) as exc:
                self._template_error = f"the chat template does not compile: {_first_line(exc)}"

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """`limit`: refuse, before tokenizing, a text whose length alone proves it holds more tokens than that."""
        if limit is not None:
            self.check_length(len(text), limit)
        if not isinstance(text, str):
            raise EdgeMoEError(f"a prompt must be text or a list of token ids, got {type(text).__name__}")
        try:
            text.encode()  # a lone surrogate (bytes that were not UTF-8) fails deep in tokenizers as a TypeError
        except UnicodeEncodeError as exc:
            raise EdgeMoEError(
                f"the text is not valid Unicode: a lone surrogate at character {exc.start} (input that is not UTF-8?)"
            ) from None
        # encode_batch lets go of the GIL while it works (encode holds it: 3.6 s for a 3.9 MB text, during which the
        # server's event loop, which called this from a worker thread, stood still); the ids are the same
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def check_length(self, chars: int, limit: int, tokens: int = 0) -> None:
        """Refuse a prompt of `chars` characters of text and `tokens` tokens besides whose length alone proves it
        holds more than `limit` tokens."""
        if chars > (limit - tokens) * self.max_token_chars:
            at_least = tokens + chars // self.max_token_chars
            raise EdgeMoEError(
                f"the prompt has {chars} characters, at least {at_least} tokens; the context limit is {limit}"
            )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token covers: no text of n characters has fewer than n / this tokens (a
        vocabulary entry's length bounds the bytes it matches, and a character is at least one byte)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def added_token(self, text: str) -> int | None:
        """The id of `text` if it is one of the tokenizer's added tokens (markup such as `<tool_call>`), else None."""
        return self._added.get(text)

    @functools.cached_property
    def _added(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    def to_json(self) -> str:
        """The tokenizer as a `tokenizer.json` document (what the grammar library builds its own from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        """Render `messages` (and `tools`, in the OpenAI function format, as Hugging Face templates take them);
        `kwargs` are the template's own switches, e.g. `enable_thinking`."""
        if self._template_error:
            raise EdgeMoEError(self._template_error)
        if self._template is None:
            raise EdgeMoEError("this model has no chat template (tokenizer_config.json: chat_template)")
        try:
            return self._template.render(
                **kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:  # the template's own raise_exception, or a sandbox refusal
            raise EdgeMoEError(f"chat template: {_first_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - a template is code: {{ 1/0 }}, a bad call, a wrong type
            raise EdgeMoEError(f"the chat template failed: {type(exc).__name__}: {_first_line(exc)}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _token_text(tok: str | dict | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, never splitting a multi-byte character.

    Each step decodes a short window of ids twice (with and without the new ones) so that tokenizers
    whose decode depends on neighbours (leading-space handling) still give the right delta.
    The window starts inside the prompt, so the first delta keeps its leading space.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 4, skip_special_tokens: bool = True
    ) -> None:
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # ids before this were already turned into text

    def step(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip_special_tokens)
        after = self.tok.decode(self.ids[self.prefix :], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character (or only special tokens): wait for more ids
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]
