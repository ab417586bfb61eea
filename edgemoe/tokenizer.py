"""Tokenizer (Hugging Face `tokenizers`), chat template (jinja2) and incremental detokenisation."""

from __future__ import annotations

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
        self._setup(json.loads(cfg_path.read_text()) if cfg_path.is_file() else {})

    @classmethod
    def from_gguf(cls, ckpt) -> Tokenizer:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
        """The tokenizer and chat template a GGUF file's metadata holds."""
        from edgemoe.models.gguf_tokenizer import tokenizer_from_gguf

        text, config = tokenizer_from_gguf(ckpt.readers[0])
        tokenizer = cls.__new__(cls)
        try:
            tokenizer._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise EdgeMoEError(f"{ckpt.path.name}: cannot build its tokenizer: {str(exc).splitlines()[0]}") from None
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
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = _compile(template) if template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        """Render `messages` (and `tools`, in the OpenAI function format, as Hugging Face templates take them);
        `kwargs` are the template's own switches, e.g. `enable_thinking`."""
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
        except jinja2.TemplateError as exc:
            raise EdgeMoEError(f"chat template: {exc}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


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
