"""Prefill attention on CUDA (`PagedAttention._prefill`) reaches SDPA's flash kernel alone, with grouped K/V as they
are: a whole prompt (is_causal) and a later chunk (keys before its queries: `causal_lower_right`, no [new, keys] mask);
both match a float32 dense-mask reference (bf16: 2e-2). Left to itself prefill never runs SDPA's cuDNN backend (a plan
built per new prompt length, tens of ms)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from edgemoe.context import ForwardContext, set_context
from edgemoe.layers.attention import PagedAttention

HEADS, KV_HEADS, D, BS = 32, 4, 128, 16  # qwen3-30b-a3b's attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """q: [new, heads, d]; k, v: [keys, kv_heads, d] -> [new, heads * d], float32, the causal mask spelled out."""
    new = q.shape[0]
    mask = torch.arange(n_ctx, device=q.device)[None, :] <= torch.arange(n_ctx - new, n_ctx, device=q.device)[:, None]
    qf, kf, vf = (t.float().transpose(0, 1)[None] for t in (q, k, v))
    kf, vf = kf.repeat_interleave(HEADS // KV_HEADS, 1), vf.repeat_interleave(HEADS // KV_HEADS, 1)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=D**-0.5)
    return out[0].transpose(0, 1).reshape(new, HEADS * D)


def run_prefill(n_new: int, n_ctx: int, backend: SDPBackend | None) -> None:
    """One sequence's prefill attention (n_new queries, n_ctx keys, its blocks out of order), under `backend` alone
    (None: the engine's own choice), against the reference."""
    g = torch.Generator(device="cuda").manual_seed(n_new)
    blocks = -(-n_ctx // BS)
    attn = PagedAttention(HEADS, KV_HEADS, D)
    k_cache = torch.randn(blocks * BS + BS, KV_HEADS, D, generator=g, device="cuda").bfloat16()
    attn.bind(k_cache, torch.randn(blocks * BS + BS, KV_HEADS, D, generator=g, device="cuda").bfloat16(), BS)
    table = torch.randperm(blocks, generator=g, device="cuda")  # the sequence's blocks, out of order
    q = torch.randn(n_new, HEADS, D, generator=g, device="cuda").bfloat16()
    slots = (table[:, None] * BS + torch.arange(BS, device="cuda")).flatten()[:n_ctx]
    empty = torch.empty(0, dtype=torch.long, device="cuda")
    ctx = ForwardContext(True, empty, torch.tensor([n_ctx], device="cuda"), table[None], [n_new], [n_ctx])
    set_context(ctx)
    try:
        if backend is None:
            out = attn.attend(q)
        else:
            with sdpa_kernel(backend):  # raises if SDPA cannot run this backend
                out = attn.attend(q)
    finally:
        set_context(None)
    want = reference(q, attn.k_cache[slots], attn.v_cache[slots], n_ctx)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "n_new, n_ctx, backend", [(512, 512, SDPBackend.FLASH_ATTENTION), (200, 712, SDPBackend.FLASH_ATTENTION)]
)
def test_prefill_runs_the_fused_backend(n_new: int, n_ctx: int, backend: SDPBackend) -> None:
    run_prefill(n_new, n_ctx, backend)


@pytest.mark.parametrize(("n_new", "n_ctx"), [(333, 333), (77, 410)])
def test_prefill_leaves_cudnn_out(n_new: int, n_ctx: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_prefill(n_new, n_ctx, None)
    ops = {e.key for e in prof.key_averages()}
    assert not any("cudnn" in op for op in ops), sorted(op for op in ops if "attention" in op)
    assert any("flash_attention" in op for op in ops), sorted(op for op in ops if "attention" in op)
