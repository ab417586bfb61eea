"""Attention over the paged KV cache.

The cache of one layer is two tensors `[num_slots, kv_heads, head_dim]`; slot = block * block_size + offset.
Decode attends with fixed shapes (block tables padded to a fixed width, masked by context length), so a CUDA
graph can capture it: on CUDA the Triton kernel `edgemoe.kernels.paged_attention` reads K/V in place up to each
context length; elsewhere (and for head_dims it does not take) `_decode_torch`, its reference, gathers the padded
table and masks. Prefill (plain torch) loops over sequences, which may have any length. Under the causal `visible` a
sequence's new tokens are the last rows of its causal square (a whole prompt, a later chunk, a prompt after a cached
prefix), which `causal_lower_right` tells SDPA without a mask: on CUDA flash attention takes it with grouped K/V as
they are (no mask, no K/V repeated per query head); on the CPU torch builds the mask itself. A sliding `window`
narrows `visible` to the last keys: a [new, keys] mask, with K/V repeated per query head so that CUDA can run the
memory-efficient kernel. Attention `sinks` (gpt-oss: a learnt logit per head in the softmax's denominator, no value)
have no SDPA form: those layers' prefill computes the scores itself (`sink_attention`, transformers' eager attention),
in blocks of queries that bound the scores' memory, plain torch on every device. Decode's kernel takes both (the
window's blocks alone are read; the sink joins its softmax's denominator), `_decode_torch` stays their reference. On
CUDA prefill leaves SDPA's cuDNN backend out (`PREFILL_BACKENDS`): it builds a plan for every new query length on the
CPU, which every agent-loop turn, whose prompt is a length never seen, paid (docs/findings.md, "Streamed prefill").

`Attention` is the block every family shares: one qkv projection, an optional per-head q/k norm, RoPE, the KV-cache
write and paged attention, the output projection. A family that transforms q, k, v before RoPE (OLMoE's norm over
all heads, its clip) subclasses it and overrides `transform_qkv`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from edgemoe.context import get_context
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding

PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # CUDA: no cuDNN
SINK_SCORES = 2**26  # scores a prefill block of a layer with sinks holds at most (256 MiB in float32)


class PagedAttention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None, sinks: bool = False
    ) -> None:
        """`window`: a query sees only the last `window` keys (itself included), None for all; `sinks`: a learnt
        logit per head joins the softmax's denominator (`self.sinks` [heads], transformers' name)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.window = window
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # the cache binds these (`KVCache.bind`): its block size and this layer's views of its pool
        self.block_size = 0
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self._decode_kernel = None  # the Triton kernel, once `use_kernels` chose it

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> None:
        """This layer's views of a KV cache's pool, [slots, kv_heads, head_dim] each, in blocks of `block_size`."""
        self.k_cache, self.v_cache, self.block_size = k_cache, v_cache, block_size

    def use_kernels(self, device: torch.device) -> None:
        if self.head_dim >= 16 and self.head_dim & (self.head_dim - 1) == 0:  # its tiles need a power of 2
            from edgemoe.kernels.paged_attention import paged_decode_attention

            self._decode_kernel = paged_decode_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads * head_dim]
        self.write_kv(k, v)
        return self.attend(q)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's k, v [tokens, kv_heads, head_dim] into their KV-cache slots."""
        slots = get_context().slot_mapping
        self.k_cache.index_copy_(0, slots, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(0, slots, v.to(self.v_cache.dtype))

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """`forward` once the cache holds this step's k and v (on CUDA `attention_prologue` writes them, fused with
        norm and rotary). q: [tokens, heads, head_dim] -> [tokens, heads * head_dim]"""
        ctx = get_context()
        if ctx.is_prefill:
            with sdpa_kernel(PREFILL_BACKENDS) if q.is_cuda else contextlib.nullcontext():
                out = self._prefill(q, ctx)
        else:
            out = self._decode(q, ctx)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # block_tables: [seqs, blocks] -> k, v: [seqs, kv_heads, blocks * block_size, head_dim]
        offsets = torch.arange(self.block_size, device=block_tables.device)
        slots = (block_tables[:, :, None] * self.block_size + offsets).flatten(1)  # [seqs, keys]
        return self.k_cache[slots].transpose(1, 2), self.v_cache[slots].transpose(1, 2)

    def _decode(self, q: torch.Tensor, ctx) -> torch.Tensor:
        if self._decode_kernel is not None:
            return self._decode_kernel(
                q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale, self.block_size,
                window=self.window, sinks=self.sinks,
            )  # fmt: skip
        return self._decode_torch(q, ctx)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Which keys a query sees, by position (broadcast): causal, within the last `window` where there is one.
        The Triton decode kernel takes the same window; prefill's maskless causal path the window-less ones only."""
        seen = k_pos <= q_pos
        return seen if self.window is None else seen & (k_pos > q_pos - self.window)

    def _decode_torch(self, q: torch.Tensor, ctx) -> torch.Tensor:
        # reads and copies the whole padded width: the reference of the kernel
        k, v = self._gather(ctx.block_tables)
        keys = torch.arange(k.shape[2], device=q.device)
        mask = self.visible((ctx.context_lens - 1)[:, None], keys[None, :])[:, None, None, :]  # [seqs, 1, 1, keys]
        if self.sinks is not None:
            return sink_attention(q[:, :, None, :], k, v, mask, self.scale, self.sinks)[:, :, 0, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return out[:, :, 0, :]  # [seqs, heads, head_dim]

    def _prefill(self, q: torch.Tensor, ctx) -> torch.Tensor:
        outs, start, groups = [], 0, self.num_heads // self.num_kv_heads
        causal = self.window is None and self.sinks is None
        for i, (n_new, n_ctx) in enumerate(zip(ctx.query_lens, ctx.context_lens_host)):
            n_blocks = -(-n_ctx // self.block_size)
            k, v = self._gather(ctx.block_tables[i : i + 1, :n_blocks])
            k, v = k[:, :, :n_ctx], v[:, :, :n_ctx]
            qi = q[start : start + n_new].transpose(0, 1)[None]  # [1, heads, new, head_dim]
            if causal:  # the last n_new rows of the causal square: no mask (flash on CUDA, which also takes GQA)
                # a whole prompt as is_causal (the path measured on the H200); a later chunk through the bias object
                bias = None if n_new == n_ctx else causal_lower_right(n_new, n_ctx)
                o = F.scaled_dot_product_attention(
                    qi, k, v, attn_mask=bias, is_causal=bias is None, scale=self.scale, enable_gqa=groups > 1
                )
            else:  # a window: a mask, which the efficient kernel takes, not GQA
                q_pos = torch.arange(n_ctx - n_new, n_ctx, device=q.device)
                mask = self.visible(q_pos[:, None], torch.arange(n_ctx, device=q.device)[None, :])  # [new, keys]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                if self.sinks is None:
                    o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=self.scale)
                else:  # blocks of queries: their scores [heads, rows, keys] stay within SINK_SCORES
                    rows = max(1, SINK_SCORES // (self.num_heads * n_ctx))
                    o = torch.cat([
                        sink_attention(qi[:, :, r : r + rows], k, v, mask[r : r + rows], self.scale, self.sinks)
                        for r in range(0, n_new, rows)
                    ], dim=2)  # fmt: skip
            outs.append(o[0].transpose(0, 1))
            start += n_new
        return torch.cat(outs)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax also counts a learnt logit per head (`sinks` [heads]) that attends to nothing, so a
    head may attend to little. q: [seqs, heads, new, d]; k, v: [seqs, heads or kv_heads, keys, d]; mask: True where
    a query sees a key (broadcast to [seqs, heads, new, keys]) -> [seqs, heads, new, d]. Scores in q's dtype, the
    maximum subtracted before the softmax, as transformers' eager attention computes them."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))  # [seqs, heads, new, keys]
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


class Attention(nn.Module):
    """Self-attention of a pre-norm decoder layer over the paged KV cache (Hugging Face parameter names, except q/k/v
    as one `qkv_proj` whose row blocks the loader fills from q_proj, k_proj and v_proj: decode reads one weight in
    one launch, not three)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        o_bias: bool = False,
        head_norm_eps: float | None = None,
    ) -> None:
        """`head_norm_eps`: a per-head RMSNorm of q and k before RoPE (Qwen3), None for none."""
        super().__init__()
        self.nq, self.nkv, self.d = num_heads, num_kv_heads, head_dim
        self.qkv_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.qkv_proj = DecodeLinear(hidden, sum(self.qkv_sizes), bias=qkv_bias)
        self.o_proj = DecodeLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.q_norm = self.k_norm = None
        self.head_norm = head_norm_eps is not None
        if self.head_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim, head_norm_eps), RMSNorm(head_dim, head_norm_eps)
        self.rotary = [rotary]  # shared, and kept out of this module's parameters
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim)
        self._prologue = self._prologue_reference
        self._norm_gemv = None  # decode's input norm inside the qkv GEMV (GPUs without PDL), once chosen

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.dense_gemv import norm_gemv
        from edgemoe.kernels.pdl import use_pdl

        self._prologue = self._prologue_kernel
        # only without PDL: with it, the fused GEMV crowds the MoE down kernel (docs/findings.md, "Norm fusion")
        self._norm_gemv = None if use_pdl(device) else norm_gemv

    def transform_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A family's change to q, k, v [tokens, heads * head_dim] before the per-head norm and RoPE (none here)."""
        return q, k, v

    def forward(self, x: torch.Tensor | None, positions: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """x: [tokens, hidden] (normed); `qkv`: x's projection, already made (`add_norm_forward`; x is then None)."""
        qkv = self.qkv_proj(x) if qkv is None else qkv
        q, k, v = self.transform_qkv(*qkv.split(self.qkv_sizes, dim=-1))  # [tokens, heads * head_dim] each
        q, k, v = q.view(-1, self.nq, self.d), k.view(-1, self.nkv, self.d), v.view(-1, self.nkv, self.d)
        return self.o_proj(self.attn.attend(self._prologue(q, k, v, positions)))

    def _prologue_reference(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Per-head q/k norm, RoPE and the KV-cache write -> rotated q (the reference of `_prologue_kernel`)."""
        if self.head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        self.attn.write_kv(k, v)
        return q

    def _prologue_kernel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The same in one launch instead of up to five, which lets paged attention start before it waits for qkv."""
        from edgemoe.kernels.norm_rope import attention_prologue

        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.head_norm else (None, None, 0.0)
        cache = (self.attn.k_cache, self.attn.v_cache, get_context().slot_mapping)
        rotary = self.rotary[0]
        return attention_prologue(q, k, v, positions, rotary.cos_sin, *cache, *norms, rotary_dim=rotary.rotary_dim)

    def fuses_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> bool:
        """Whether `add_norm_forward` runs `norm` inside the qkv GEMV: chosen (GPUs without PDL), one token, one dtype
        throughout, a row that `norm_gemv` holds."""
        if self._norm_gemv is None or x.dim() != 2 or x.shape[0] != 1 or not isinstance(self.qkv_proj, DecodeLinear):
            return False  # (a `QuantLinear` qkv has its own kernel)
        from edgemoe.kernels.dense_gemv import MAX_NORM_HIDDEN

        tensors = (x, residual, norm.weight, self.qkv_proj.weight)
        return len({t.dtype for t in tensors}) == 1 and x.shape[1] <= MAX_NORM_HIDDEN

    def add_norm_forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(norm(x, residual), positions)` with the residual add and the norm inside the qkv GEMV (where
        `fuses_norm`): one launch fewer -> (attention output, x + residual)."""
        qkv, h = self._norm_gemv(x, residual, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias)
        return self(None, positions, qkv), h
