"""An in-process `edgemoe serve` on the demo model dressed as a tool-calling model, whose output can be scripted:
what the server tests and the replayed agent sessions (`agent_sessions.py`) run on.

The demo model cannot choose to call a tool, so its output is scripted: `ScriptedOutput` is installed through the
engine's public `logits_processors` and leaves one token possible at each step, so the scripted text still goes
through the real sampler, the engine's stop checks and the incremental detokenizer. The rest of the server (chat
templates, parsers, replay, the prefix cache, the API writers) is the real one.
"""

from __future__ import annotations

import collections
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from safetensors.torch import load_file, save_file

from edgemoe import LLM, demo_model_path
from edgemoe.engine.engine import LLMEngine
from edgemoe.engine.sequence import Sequence
from edgemoe.server.app import ServerConfig, create_app
from edgemoe.server.engine_loop import EngineLoop
from edgemoe.server.metrics import Metrics
from edgemoe.tokenizer import Tokenizer

# A Qwen3-style template (edgemoe's own, not Qwen's): tools in the system turn, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> in a user turn, past reasoning shown after the last user turn, enable_thinking.
QWEN3_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall one as:\\n<tool_call>\\n{"name": <name>, "arguments": <object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role in ('user', 'system') %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if m.reasoning_content and loop.index0 > ns.last_user %}
{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{%- if call.function.arguments is string %}{{- call.function.arguments }}
{%- else %}{{- call.function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
QWEN_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]


def make_model(
    folder: Path,
    template: str,
    tokens: list[str],
    special: bool = False,
    context: int | None = None,
    layers: int | None = None,
) -> Path:
    """The demo model with `template` as its chat template and `tokens` as whole tokens. The model's vocabulary is
    full, so each new token takes the id of one of the last-learned BPE tokens (its merges removed): the embedding
    rows exist, and other text tokenizes almost as before. `context`: its context in tokens instead of the 2,048 it
    was trained on (RoPE positions have no limit; an agent's session needs tens of thousands). `layers`: only its
    first layers (a faster model where what it would say does not matter: scripted answers)."""
    folder.mkdir(parents=True, exist_ok=True)
    demo = demo_model_path()
    shutil.copy(demo / "generation_config.json", folder / "generation_config.json")
    config = json.loads((demo / "config.json").read_text())
    if context is not None:
        config["max_position_embeddings"] = context
    if layers is None:
        (folder / "model.safetensors").symlink_to(demo / "model.safetensors")  # read only
    else:
        config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers])
        kept = {k: v for k, v in load_file(demo / "model.safetensors").items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}  # fmt: skip
        save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tj = json.loads((demo / "tokenizer.json").read_text())
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    taken = {t["id"] for t in tj["added_tokens"]}
    victims = [t for t, _ in sorted(vocab.items(), key=lambda kv: -kv[1]) if vocab[t] not in taken][: len(tokens)]

    def pair(m: str | list[str]) -> list[str]:
        return m.split(" ", 1) if isinstance(m, str) else m

    gone = set(victims)
    tj["model"]["merges"] = [m for m in merges if not (gone & {*pair(m), "".join(pair(m))})]
    for text, victim in zip(tokens, victims):
        tj["added_tokens"].append({"id": vocab.pop(victim), "content": text, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": special})  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    config = json.loads((demo / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder


class ScriptedOutput:
    """A logits processor: each new sequence takes the next scripted text, if any, and its sampler can only draw
    that text's tokens, then the end of the turn (`<|im_end|>`). `max_tokens` and stop strings still cut it."""

    def __init__(self, tokenizer: Tokenizer, end: str = "<|im_end|>") -> None:
        self.tokenizer = tokenizer
        self.end = tokenizer.encode(end, add_special_tokens=False)[0]
        self._queue: collections.deque[list[int]] = collections.deque()
        self._scripts: dict[int, list[int]] = {}  # seq_id -> its script's ids (engine thread only)

    def push(self, *texts: str | list[int]) -> None:
        """Script the next len(texts) sequences (a request with n choices takes n). A text is drawn as the tokenizer
        cuts it; a list of ids as given (a cut the tokenizer would not choose, as a sampled answer may be)."""
        for text in texts:
            ids = list(text) if isinstance(text, list) else self.tokenizer.encode(text, add_special_tokens=False)
            if not isinstance(text, list):
                assert self.tokenizer.decode(ids, skip_special_tokens=False) == text, "the script must round-trip"
            self._queue.append(ids)

    def pending(self) -> int:
        return len(self._queue)

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            ids = self._scripts.get(seq.seq_id)
            if ids is None:
                if seq.output_ids or not self._queue:
                    continue  # a sequence that started unscripted stays free
                ids = self._scripts[seq.seq_id] = self._queue.popleft()
            step = len(seq.output_ids)
            logits[row] = float("-inf")
            logits[row, ids[step] if step < len(ids) else self.end] = 0.0
        return logits


class PromptLog:
    """A logits processor that changes nothing: the prompt ids of each request (by its id), in arrival order."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for seq in seqs:
            self.prompts.setdefault(seq.request_id, seq.token_ids[: seq.num_prompt_tokens])
        return logits

    def last(self, n: int) -> list[list[int]]:
        return list(self.prompts.values())[-n:]


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


class InProcessServer:
    """The serve app (engine thread + uvicorn) in this process, so that tests and benchmarks reach the engine's
    Python API (`script`, `engine_loop.engine.logits_processors`)."""

    def __init__(
        self, model: Path, api_key: str = "test-key", kv_cache_tokens: int | None = None, **options: object
    ) -> None:
        """`kv_cache_tokens`: the engine's (default: room for 4 sequences of the model's context); `options`:
        ServerConfig fields (tool_parser, reasoning_parser, replay_tokens)."""
        self.model_id, self.api_key = model.name, api_key
        self.script = ScriptedOutput(Tokenizer(model))

        def make_engine() -> LLMEngine:
            engine = LLM(model=str(model), max_num_seqs=4, progress=False, kv_cache_tokens=kv_cache_tokens).engine
            engine.logits_processors.append(self.script)
            return engine

        self.engine_loop = EngineLoop(make_engine, 4, 8, Metrics())
        config = ServerConfig(self.model_id, api_key=api_key, **options)
        app = create_app(self.engine_loop, self.engine_loop.metrics, config)
        sock = free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        uv = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.engine_loop.start()
        self.thread.start()
        deadline = time.monotonic() + 300  # generous: a busy machine loads slowly
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline and self.engine_loop.error is None, self.engine_loop.error
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine_loop.stop()
        self.engine_loop.join(10)
