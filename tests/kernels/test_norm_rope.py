"""RMSNorm and rotary kernels (Triton's interpreter on CPU) against their torch references, `RMSNorm._forward_torch`
and `RotaryEmbedding._forward_torch`, on fresh random inputs and weights: head dims and hidden sizes off powers of
two, 3-D per-head norms, strided views, mixed weight / activation dtypes, repeated positions, MHA / GQA / MQA.

Rotary rounds where torch does, so it must be bitwise equal in every dtype. The norm sums its squares in another
order than torch, so float32 is held to 1e-6 relative, and 16-bit inputs to a rare flipped rounding of x * rsqrt."""

from __future__ import annotations

import pytest
import torch

from edgemoe.kernels.norm_rope import apply_rotary, rms_norm
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding

EPS = 1e-6
HALF = [torch.bfloat16, torch.float16]


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data = weight
    return norm._forward_torch(x)


def random_weight(dim: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(dim)).to(dtype)  # around one, as trained norms are, but not ones


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, x_dtype: torch.dtype) -> None:
    """Float32: the sum order only (1e-6). 16-bit x: x * r may round to the neighbouring value (one ulp of x's dtype),
    which the weight then scales, so 2.5 ulps relative bound it; and such flips must be rare."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-6 if x_dtype == torch.float32 else 2.5 * torch.finfo(x_dtype).eps
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.0)
    if x_dtype != torch.float32:
        assert (out == ref).float().mean() >= 0.99


@pytest.mark.parametrize("shape", [(5, 96), (3, 200), (4, 256), (1, 1000)], ids=str)
def test_rms_norm_float32_matches_reference(shape) -> None:
    x = 3 * torch.randn(*shape)
    weight = random_weight(shape[-1], torch.float32)
    assert_close_to_reference(rms_norm(x, weight, EPS), norm_reference(x, weight), torch.float32)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", [(6, 96), (3, 200), (2, 1000)], ids=str)
def test_rms_norm_half_matches_reference(shape, dtype) -> None:
    x = (3 * torch.randn(*shape)).to(dtype)
    weight = random_weight(shape[-1], dtype)
    assert_close_to_reference(rms_norm(x, weight, EPS), norm_reference(x, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_per_head(dtype) -> None:
    # Qwen3's q/k norm: [tokens, heads, head_dim], normalised per head; also a slice whose rows do not flatten
    x = torch.randn(3, 4, 96).to(dtype)
    weight = random_weight(96, dtype)
    wide = torch.randn(3, 4, 160).to(dtype)
    for view in (x, wide[:, :, 32:128]):
        assert_close_to_reference(rms_norm(view, weight, 1e-5), norm_reference(view, weight, 1e-5), dtype)


def test_rms_norm_strided_last_dim() -> None:
    x = torch.randn(96, 5).t()  # [5, 96] with a last-dim stride of 5
    weight = random_weight(96, torch.float32)
    assert_close_to_reference(rms_norm(x, weight, EPS), norm_reference(x, weight), torch.float32)


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)],
    ids=str,
)
def test_rms_norm_mixed_dtypes_promote_like_torch(x_dtype, w_dtype) -> None:
    # the engine keeps weight and activations alike; torch's `weight * x.to(dtype)` promotes when they differ
    x = torch.randn(4, 200).to(x_dtype)
    weight = random_weight(200, w_dtype)
    ref = norm_reference(x, weight)
    assert ref.dtype == torch.float32
    assert_close_to_reference(rms_norm(x, weight, EPS), ref, x_dtype)


def rotary_table(dim: int, max_positions: int = 4096) -> RotaryEmbedding:
    rotary = RotaryEmbedding(dim, max_positions, 1e6)
    rotary.build("cpu")
    return rotary


def random_positions(tokens: int, max_positions: int = 4096) -> torch.Tensor:
    positions = torch.randint(0, max_positions, (tokens,))
    positions[-1] = positions[0]  # repeated positions read one row twice
    return positions


# (heads, kv_heads, head_dim)
ROTARY_SHAPES = [(4, 4, 64), (8, 2, 96), (6, 1, 200), (3, 1, 32)]  # MHA, GQA, MQA off powers of two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_rotary_bitwise_equal(shape, dtype) -> None:
    heads, kv_heads, dim = shape
    rotary = rotary_table(dim)
    positions = random_positions(5)
    q, k = torch.randn(5, heads, dim).to(dtype), torch.randn(5, kv_heads, dim).to(dtype)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = apply_rotary(q, k, rotary.cos_sin, positions)
    q_ref, k_ref = rotary._forward_torch(positions, q, k)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # new outputs, inputs untouched


def test_rotary_random_table_and_int32_positions() -> None:
    # a table of arbitrary values (not just cos/sin in [-1, 1]) still rounds like torch
    rotary = RotaryEmbedding(96, 64, 1e4)
    rotary.cos_sin = 2 * torch.randn(2, 64, 96)
    positions = random_positions(4, 64).to(torch.int32)
    q, k = torch.randn(4, 4, 96).to(torch.bfloat16), torch.randn(4, 2, 96).to(torch.bfloat16)
    q_out, k_out = apply_rotary(q, k, rotary.cos_sin, positions)
    q_ref, k_ref = rotary._forward_torch(positions, q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_rotary_strided_views() -> None:
    # q and k as views of a fused qkv projection output, and a q whose head_dim is not contiguous
    heads, kv_heads, dim, tokens = 4, 2, 64, 3
    rotary = rotary_table(dim)
    positions = random_positions(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    for q_view in (q, q.transpose(1, 2).contiguous().transpose(1, 2)):
        q_out, k_out = apply_rotary(q_view, k, rotary.cos_sin, positions)
        q_ref, k_ref = rotary._forward_torch(positions, q_view, k)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_no_tokens() -> None:
    rotary = rotary_table(32)
    q_out, k_out = apply_rotary(torch.randn(0, 4, 32), torch.randn(0, 1, 32), rotary.cos_sin, torch.zeros(0).long())
    assert q_out.shape == (0, 4, 32) and k_out.shape == (0, 1, 32)
    assert rms_norm(torch.randn(0, 96), torch.randn(96), EPS).shape == (0, 96)
