"""Attention over the paged KV cache.

The cache of one layer is two tensors `[num_slots, kv_heads, head_dim]`; slot = block * block_size + offset.
Decode attends with fixed shapes (block tables padded to a fixed width, masked by context length), so a CUDA
graph can capture it: on CUDA the Triton kernel `edgemoe.kernels.paged_attention` reads K/V in place up to each
context length; elsewhere (and for head_dims it does not take) `_decode_torch`, its reference, gathers the padded
table and masks. Prefill (plain torch) loops over sequences, which may have any length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.engine.context import get_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5
        self.fused_decode = head_dim >= 16 and head_dim & (head_dim - 1) == 0  # the kernel's tiles need a power of 2
        self.k_cache = torch.empty(0)  # assigned by the KV cache
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]
        slots = get_context().slot_mapping
        self.k_cache.index_copy_(0, slots, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(0, slots, v.to(self.v_cache.dtype))
        return self.attend(q)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """`forward` once the cache holds this step's k and v (on CUDA `attention_prologue` writes them, fused with
        norm and rotary). q: [tokens, heads, head_dim] -> [tokens, heads * head_dim]"""
        ctx = get_context()
        out = self._prefill(q, ctx) if ctx.is_prefill else self._decode(q, ctx)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # block_tables: [seqs, blocks] -> k, v: [seqs, kv_heads, blocks * block_size, head_dim]
        offsets = torch.arange(self.block_size, device=block_tables.device)
        slots = (block_tables[:, :, None] * self.block_size + offsets).flatten(1)  # [seqs, keys]
        return self.k_cache[slots].transpose(1, 2), self.v_cache[slots].transpose(1, 2)

    def _decode(self, q: torch.Tensor, ctx) -> torch.Tensor:
        if q.is_cuda and self.fused_decode:
            from edgemoe.kernels.paged_attention import paged_decode_attention  # CPU-only machines lack triton

            return paged_decode_attention(
                q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale, self.block_size
            )
        return self._decode_torch(q, ctx)

    def _decode_torch(self, q: torch.Tensor, ctx) -> torch.Tensor:
        # reads and copies the whole padded width: the reference of the kernel
        k, v = self._gather(ctx.block_tables)
        keys = torch.arange(k.shape[2], device=q.device)
        mask = (keys[None, :] < ctx.context_lens[:, None])[:, None, None, :]  # [seqs, 1, 1, keys]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return out[:, :, 0, :]  # [seqs, heads, head_dim]

    def _prefill(self, q: torch.Tensor, ctx) -> torch.Tensor:
        outs, start = [], 0
        for i, (n_new, n_ctx) in enumerate(zip(ctx.query_lens, ctx.context_lens_host)):
            n_blocks = -(-n_ctx // self.block_size)
            k, v = self._gather(ctx.block_tables[i : i + 1, :n_blocks])
            k, v = k[:, :, :n_ctx], v[:, :, :n_ctx]
            q_pos = torch.arange(n_ctx - n_new, n_ctx, device=q.device)
            mask = torch.arange(n_ctx, device=q.device)[None, :] <= q_pos[:, None]  # [new, keys]
            qi = q[start : start + n_new].transpose(0, 1)[None]  # [1, heads, new, head_dim]
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
            outs.append(o[0].transpose(0, 1))
            start += n_new
        return torch.cat(outs)
