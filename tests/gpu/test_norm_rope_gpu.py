"""RMSNorm and rotary kernels (`edgemoe.kernels.norm_rope`) compiled on CUDA against their torch references
(`RMSNorm._forward_torch`, `RotaryEmbedding._forward_torch`) at real shapes in float32 and bf16, without host
synchronisation, through the layers' CUDA dispatch, and replayed from a CUDA graph with new inputs.

Rotary must be bitwise equal (it rounds where torch's separate ops round; no FMA). The norm sums in another order than
torch's reduction: float32 within 1e-6 relative, bf16 within a rare flipped rounding of x * rsqrt."""

from __future__ import annotations

import pytest
import torch

from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
MAX_POSITIONS = 40960  # Qwen3's table
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dtype)


def make_norm(dim: int, dtype: torch.dtype, g: torch.Generator, weight_dtype: torch.dtype | None = None) -> RMSNorm:
    norm = RMSNorm(dim, EPS).cuda()
    norm.weight.data = (1 + 0.5 * torch.randn(dim, generator=g, device="cuda")).to(weight_dtype or dtype)
    return norm


def make_rotary() -> RotaryEmbedding:
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, 1e6)
    rotary.build("cuda")
    return rotary


def positions(tokens: int, g: torch.Generator) -> torch.Tensor:
    p = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g, device="cuda")
    p[-1] = p[0]  # a repeated position
    return p


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, x_dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-6 if x_dtype == torch.float32 else 2.5 * torch.finfo(x_dtype).eps
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.0)
    if x_dtype != torch.float32:
        assert (out == ref).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_rms_norm_matches_reference(hidden: int, tokens: int, dtype: torch.dtype) -> None:
    from edgemoe.kernels.norm_rope import rms_norm

    g = gen(tokens)
    norm = make_norm(hidden, dtype, g)
    x = randn(tokens, hidden, g=g, dtype=dtype, scale=3.0)
    out = rms_norm(x, norm.weight, EPS)
    assert_close_to_reference(out, norm._forward_torch(x), dtype)
    assert torch.equal(norm(x), out)  # the layer dispatches to the kernel on CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 9])
def test_per_head_norm_on_projection_views(tokens: int, dtype: torch.dtype) -> None:
    # Qwen3's q/k norm on views of the projection outputs, [tokens, heads, head_dim]
    g = gen(100 + tokens)
    q_norm, k_norm = make_norm(HEAD_DIM, dtype, g), make_norm(HEAD_DIM, dtype, g)
    q = randn(tokens, HEADS * HEAD_DIM, g=g, dtype=dtype).view(-1, HEADS, HEAD_DIM)
    k = randn(tokens, KV_HEADS * HEAD_DIM, g=g, dtype=dtype).view(-1, KV_HEADS, HEAD_DIM)
    assert_close_to_reference(q_norm(q), q_norm._forward_torch(q), dtype)
    assert_close_to_reference(k_norm(k), k_norm._forward_torch(k), dtype)


def test_rms_norm_mixed_dtypes_promote_like_torch() -> None:
    g = gen(7)
    norm = make_norm(2048, torch.bfloat16, g, weight_dtype=torch.float32)
    x = randn(5, 2048, g=g, dtype=torch.bfloat16)
    out, ref = norm(x), norm._forward_torch(x)
    assert out.dtype == ref.dtype == torch.float32
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_rotary_bitwise_equal(tokens: int, dtype: torch.dtype) -> None:
    g = gen(200 + tokens)
    rotary = make_rotary()
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, dtype=dtype, scale=2.0)  # q, k: views of it
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    before = qkv.clone()
    pos = positions(tokens, g)
    q_out, k_out = rotary(pos, q, k)
    q_ref, k_ref = rotary._forward_torch(pos, q, k)
    assert q_out.dtype == dtype and torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(qkv, before)  # not in place


def test_no_host_sync_once_compiled() -> None:
    from edgemoe.kernels.norm_rope import apply_rotary, rms_norm

    g = gen(0)
    rotary = make_rotary()
    x, w = randn(1, 2048, g=g, dtype=torch.bfloat16), randn(2048, g=g, dtype=torch.bfloat16)
    q, k = randn(1, HEADS, HEAD_DIM, g=g, dtype=torch.bfloat16), randn(1, KV_HEADS, HEAD_DIM, g=g, dtype=torch.bfloat16)
    pos = positions(1, g)
    rms_norm(x, w, EPS)  # compiles (may sync)
    apply_rotary(q, k, rotary.cos_sin, pos)
    with torch.cuda.device(x.device):
        torch.cuda.set_sync_debug_mode("error")
        try:
            rms_norm(x, w, EPS)
            apply_rotary(q, k, rotary.cos_sin, pos)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype) -> None:
    """The attention prologue of a Qwen3 layer (input norm, per-head q/k norm, rotary) captured once over static
    buffers and replayed with new hidden states, projections and positions written into them."""
    tokens, hidden = 2, 4096
    g = gen(1)
    input_norm, q_norm, k_norm = (
        make_norm(hidden, dtype, g),
        make_norm(HEAD_DIM, dtype, g),
        make_norm(HEAD_DIM, dtype, g),
    )
    rotary = make_rotary()
    x = randn(tokens, hidden, g=g, dtype=dtype)
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, dtype=dtype)
    pos = positions(tokens, g)

    def prologue() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        q_out, k_out = rotary(pos, q_norm(q), k_norm(k))
        return input_norm(x), q_out, k_out

    prologue()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = prologue()
    for seed in range(2, 5):
        g = gen(seed)
        x.copy_(randn(tokens, hidden, g=g, dtype=dtype))
        qkv.copy_(randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, dtype=dtype))
        pos.copy_(positions(tokens, g))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        eager = prologue()
        for o, e in zip(outs, eager):
            assert torch.equal(o, e)  # every element rewritten, deterministic
        assert_close_to_reference(outs[0], input_norm._forward_torch(x), dtype)
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        q_ref, k_ref = rotary._forward_torch(pos, q_norm(q), k_norm(k))  # on the kernel's norms: rotary alone
        assert torch.equal(outs[1], q_ref) and torch.equal(outs[2], k_ref)
