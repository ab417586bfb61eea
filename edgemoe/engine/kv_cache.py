"""Paged KV cache: fixed-size blocks from one preallocated pool, handed to sequences as they grow.

A sequence holds only the blocks its tokens need, so a long context limit costs nothing up front.
Layout per layer: `[slots, kv_heads, head_dim]` with slot = block * block_size + offset. One extra
block at the end absorbs writes from padded (dummy) tokens.
"""

from __future__ import annotations

import torch

from edgemoe.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_layers, (num_blocks + 1) * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pad_block = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives low ids first

    def bind(self, attention_layers: list) -> None:
        for i, attn in enumerate(attention_layers):
            attn.k_cache, attn.v_cache = self.k[i], self.v[i]

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
