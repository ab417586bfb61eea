"""LLMEngine: loads a checkpoint, takes requests, and advances them one step at a time.

Entry points (`LLM`, the CLI, the server) drive it with `add_request` / `step` / `abort`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from edgemoe.config import EngineConfig, ModelConfig, parse_size
from edgemoe.engine.kv_cache import KVCache, bytes_per_block
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.engine.scheduler import Scheduler
from edgemoe.engine.sequence import RequestOutput, Sequence
from edgemoe.errors import EdgeMoEError
from edgemoe.models.loader import load_model
from edgemoe.models.registry import read_config
from edgemoe.sampling_params import SamplingParams
from edgemoe.tokenizer import IncrementalDetokenizer, Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def demo_model_path() -> Path:
    """The bundled demo model (a small qwen2_moe trained on Shakespeare and Milton)."""
    return Path(__file__).resolve().parent.parent / "demo_model"


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EdgeMoEError(f"unknown device {name!r}: use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EdgeMoEError("device cuda requested but CUDA is not available (no GPU, or a CPU build of torch)")
    if device.type not in ("cpu", "cuda"):
        raise EdgeMoEError(f"unsupported device {name!r}: use cpu or cuda")
    return device


def resolve_dtype(name: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        wanted = _DTYPES.get(cfg.torch_dtype, torch.float32)
        return wanted if wanted != torch.bfloat16 or torch.cuda.is_bf16_supported() else torch.float16
    if name not in _DTYPES:
        raise EdgeMoEError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        raise EdgeMoEError("float16 is not supported on the cpu device: use float32 or bfloat16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise EdgeMoEError("this GPU cannot do bfloat16: use float16 or float32")
    return dtype


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder = Path(config.model) if config.model else demo_model_path()
        if not folder.is_dir():
            raise EdgeMoEError(f"model path {folder} does not exist or is not a folder")
        self.model_config, family = read_config(folder)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        self.tokenizer = Tokenizer(folder)
        self.max_model_len = min(config.max_model_len or sys.maxsize, self.model_config.max_position_embeddings)
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1 or config.block_size < 1:
            raise EdgeMoEError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        self.model = load_model(folder, self.model_config, family, self.device, self.dtype, config.block_size,
                                config.progress)
        self.kv = KVCache(self.model_config, self._num_kv_blocks(), config.block_size, self.dtype, self.device)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._seqs: dict[str, Sequence] = {}

    def _num_kv_blocks(self) -> int:
        per_block = bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        need = self.config.max_num_seqs * (-(-self.max_model_len // self.config.block_size))
        if self.config.kv_cache_memory == "auto":
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8)
            else:
                budget = 1 << 30
            return max(1, min(need, budget // per_block))
        blocks = parse_size(self.config.kv_cache_memory) // per_block
        if blocks < 1:
            raise EdgeMoEError(f"kv_cache_memory {self.config.kv_cache_memory} holds no KV block; "
                               f"the minimum is {per_block} bytes")
        return blocks

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    chat: bool = False) -> Sequence:
        params.validate()
        if chat:
            ids = self.tokenizer.encode_chat(prompt)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or t < 0 or t >= self.model_config.vocab_size for t in ids):
                raise EdgeMoEError(f"token ids must be integers in [0, {self.model_config.vocab_size})")
        if not ids:
            raise EdgeMoEError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise EdgeMoEError(f"the prompt has {len(ids)} tokens; the context limit is {self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.scheduler.blocks_for(longest) > self.kv.num_blocks:
            raise EdgeMoEError(f"a sequence of {longest} tokens does not fit the KV cache "
                               f"({self.kv.num_blocks * self.kv.block_size} tokens); raise kv_cache_memory")
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_gen))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        seq = Sequence(ids, params, IncrementalDetokenizer(self.tokenizer, ids), generator, request_id)
        if seq.request_id in self._seqs:
            raise EdgeMoEError(f"request id {seq.request_id!r} is already in use")
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every sequence that advanced."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        tokens = self.runner.run(batch)
        outputs = []
        for seq, n, token in zip(batch.seqs, batch.num_new, tokens):
            seq.num_computed += n
            if token is None:
                continue
            self._append(seq, token)
            if seq.finish_reason:
                self.scheduler.finish(seq)
                self._seqs.pop(seq.request_id, None)
            outputs.append(seq.output())
        return outputs

    def _append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        p = seq.params
        stop_token = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if not stop_token:
            before = len(seq.text)
            seq.text += seq.detok.step([token])
            if p.stop:  # a new match must end inside the new delta
                start = max(0, before - max(map(len, p.stop)) + 1)
                hits = [i for i in (seq.text.find(s, start) for s in p.stop) if i >= 0]
                if hits:
                    seq.text = seq.text[: min(hits)]
                    seq.finish_reason = "stop"
                    return
        if stop_token:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
