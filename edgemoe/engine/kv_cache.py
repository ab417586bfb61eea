"""Paged KV cache: fixed-size blocks from one preallocated pool, handed to sequences as they grow.

A sequence holds only the blocks its tokens need, so a long context limit costs nothing up front.
Layout per layer: `[slots, kv_heads, head_dim]` with slot = block * block_size + offset. One extra
block at the end absorbs writes from padded (dummy) tokens. Layers may differ in shape, and a KV-shared layer
(`ModelConfig.kv_layers`) has no cache of its own: it is bound to the one it reads.
"""

from __future__ import annotations

import torch

from edgemoe.config import EngineConfig, ModelConfig, parse_size
from edgemoe.errors import EdgeMoEError

GPU_SHARE, CPU_BYTES = 0.8, 1 << 30  # what an automatic KV cache may take at most: of the free GPU memory; on the CPU


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * block_size * sum(h * d for i, (s, h, d) in enumerate(cfg.kv_layers()) if s == i) * dtype.itemsize


def kv_blocks(
    config: EngineConfig, per_block: int, max_model_len: int, device: torch.device, room: int | None = None
) -> tuple[int, str]:
    """How many KV blocks to allocate, and why that many (the engine says it in one line). `kv_cache_memory` or
    `kv_cache_tokens` when given, else room for `max_num_seqs` sequences of `max_model_len` tokens, within `room`
    (the share of a VRAM budget), GPU_SHARE of the free GPU memory, or CPU_BYTES. Never more blocks than
    max_num_seqs x max_model_len can use."""
    bs, seqs = config.block_size, config.max_num_seqs
    full = seqs * -(-max_model_len // bs)
    if config.kv_cache_memory != "auto":
        blocks = parse_size(config.kv_cache_memory) // per_block
        if blocks < 1:
            raise EdgeMoEError(
                f"kv_cache_memory {config.kv_cache_memory} holds no KV block; the minimum is {per_block} bytes"
            )
        return blocks, f"kv_cache_memory {config.kv_cache_memory}"
    if config.kv_cache_tokens is not None:
        blocks = -(-config.kv_cache_tokens // bs)
        if blocks > full:
            return full, f"kv_cache_tokens {config.kv_cache_tokens}, capped at max_num_seqs x max_model_len"
        return blocks, f"kv_cache_tokens {config.kv_cache_tokens}"
    if room is not None:
        cap, where = room, "the share of vram_budget it may take"
    elif device.type == "cuda":
        cap, where = int(torch.cuda.mem_get_info(device)[0] * GPU_SHARE), f"{GPU_SHARE:.0%} of the free GPU memory"
    else:
        cap, where = CPU_BYTES, f"{CPU_BYTES >> 30} GiB on the CPU"
    why = f"max_num_seqs {seqs} x max_model_len {max_model_len}"
    if full * per_block <= cap:
        return full, why
    return max(1, cap // per_block), f"{why} would take {full * per_block / 2**30:.1f} GiB; capped at {where}"


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        rows, layers = (num_blocks + 1) * block_size, cfg.kv_layers()
        total = sum(rows * h * d for i, (s, h, d) in enumerate(layers) if s == i)
        self.k = torch.zeros(total, dtype=dtype, device=device)  # every layer's own cache, one after another
        self.v = torch.zeros(total, dtype=dtype, device=device)
        views, start = {}, 0
        for i, (s, h, d) in enumerate(layers):
            if s == i:
                n = rows * h * d
                views[i] = (self.k[start : start + n].view(rows, h, d), self.v[start : start + n].view(rows, h, d))
                start += n
        self.layers = [views[s] for s, _, _ in layers]  # per layer: (k, v) [slots, kv_heads, head_dim]
        self.pad_block = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives low ids first

    def bind(self, attention_layers: list) -> None:
        for attn, (k, v) in zip(attention_layers, self.layers):
            attn.k_cache, attn.v_cache = k, v

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("KV cache exhausted (the scheduler should have checked)")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()
