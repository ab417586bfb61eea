"""RMSNorm, rotary and attention-prologue kernels (Triton's interpreter on CPU) against their torch references,
`RMSNorm.reference`, `RotaryEmbedding.forward` and `index_copy_` into the KV cache, on fresh random inputs
and weights: head dims and hidden sizes off powers of two, 3-D per-head norms, strided views, mixed weight /
activation dtypes, repeated positions, MHA / GQA / MQA, random slots in a random cache.

Rotary rounds where torch does, so it must be bitwise equal in every dtype. The norm sums its squares in another
order than torch, so float32 is held to 1e-6 relative, and 16-bit inputs to a rare flipped rounding of x * rsqrt.
The prologue must be bitwise equal to the unfused sequence (the rms_norm kernel, torch's rotary, index_copy_)."""

from __future__ import annotations

import pytest
import torch

from edgemoe.kernels.norm_rope import attention_prologue, gated_rms_norm, rms_norm
from edgemoe.layers.linear_attention import GatedRMSNorm
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from tests.kernels import interpreter_only

pytestmark = interpreter_only

EPS = 1e-6
HALF = [torch.bfloat16, torch.float16]


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data = weight
    return norm.reference(x)


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


def rotary_table(dim: int, max_positions: int = 4096, rotary_dim: int | None = None) -> RotaryEmbedding:
    rotary = RotaryEmbedding(dim, max_positions, 1e6, rotary_dim)
    rotary.build("cpu")
    return rotary


def random_positions(tokens: int, max_positions: int = 4096) -> torch.Tensor:
    positions = torch.randint(0, max_positions, (tokens,))
    positions[-1] = positions[0]  # repeated positions read one row twice
    return positions


# (heads, kv_heads, head_dim)
ROTARY_SHAPES = [(4, 4, 64), (8, 2, 96), (6, 1, 200), (3, 1, 32)]  # MHA, GQA, MQA off powers of two


def unfused_prologue(
    *case: torch.Tensor | None, kernels: bool = True, rotary_dim: int | None = None
) -> tuple[torch.Tensor, ...]:
    """What `SelfAttention` runs on the CPU: [per-head norm], rotary, index_copy_ into copies of the caches; the norm
    by the Triton kernel, or by its torch reference -> (q_out, k_cache, v_cache)."""
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w = case
    if q_w is not None:
        norm = rms_norm if kernels else norm_reference
        q, k = norm(q, q_w, EPS), norm(k, k_w, EPS)
    rotary = RotaryEmbedding(q.shape[2], cos_sin.shape[1], 1.0, rotary_dim)
    rotary.cos_sin = cos_sin
    q, k = rotary(positions, q, k)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return q, k_cache, v_cache


def fused_prologue(*case: torch.Tensor | None, rotary_dim: int | None = None) -> tuple[torch.Tensor, ...]:
    """The kernel on copies of the caches; its inputs must stay as they were -> (q_out, k_cache, v_cache)."""
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w = case
    inputs = [t.clone() for t in (q, k, v, positions, slots)]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q_out = attention_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w, EPS, rotary_dim)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v, positions, slots)))
    return q_out, k_cache, v_cache


def prologue_case(
    heads: int,
    kv_heads: int,
    dim: int,
    tokens: int,
    dtype: torch.dtype,
    norm: bool = True,
    slots: int = 64,
    cache_dtype: torch.dtype | None = None,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Random q, k, v, positions, a cache of random values (so a stray write shows) and distinct random slots in it
    (most of the cache untouched) -> attention_prologue's arguments."""
    q = (2 * torch.randn(tokens, heads, dim)).to(dtype)
    k = (2 * torch.randn(tokens, kv_heads, dim)).to(dtype)
    v = torch.randn(tokens, kv_heads, dim).to(dtype)
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim).to(cache_dtype or dtype) for _ in range(2))
    positions, slot_mapping = random_positions(tokens), torch.randperm(slots)[:tokens]
    weights = (random_weight(dim, dtype), random_weight(dim, dtype)) if norm else (None, None)
    cos_sin = rotary_table(dim, rotary_dim=rotary_dim).cos_sin
    return q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, *weights


def test_rms_norm_no_rows() -> None:
    assert rms_norm(torch.randn(0, 96), torch.randn(96), EPS).shape == (0, 96)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("shape", [(3, 8, 128), (5, 96), (2, 4, 200)], ids=str)
def test_gated_rms_norm_matches_reference(shape, dtype) -> None:
    """The Gated DeltaNet's output norm: weight * norm(x) * SiLU(z), per value head. The gate's exp is Triton's and
    the sum's order the kernel's, so 16-bit results may flip a rounding (2.5 ulps), rarely; fp32 to 1e-5."""
    x, z = (3 * torch.randn(*shape)).to(dtype), (2 * torch.randn(*shape)).to(dtype)
    norm = GatedRMSNorm(shape[-1], EPS)
    norm.weight.data = random_weight(shape[-1], dtype)
    out, ref = gated_rms_norm(x, z, norm.weight, EPS), norm.reference(x, z)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out, ref, rtol=2.5 * torch.finfo(dtype).eps, atol=1e-5)
        assert (out == ref).float().mean() >= 0.97
    assert not torch.equal(out, norm.reference(x, -z)), "the gate is read"
    norm.use_kernels(torch.device("cpu"))  # the layer's forward runs the kernel once chosen
    assert torch.equal(norm(x, z), out)


def test_gated_rms_norm_strided_views_and_bad_arguments() -> None:
    both = torch.randn(4, 2 * 64).to(torch.bfloat16)  # x and z: halves of one projection's rows
    x, z = both[:, :64], both[:, 64:]
    weight = random_weight(64, torch.bfloat16)
    assert torch.equal(gated_rms_norm(x, z, weight, EPS), gated_rms_norm(x.contiguous(), z.contiguous(), weight, EPS))
    assert gated_rms_norm(x[:0], z[:0], weight, EPS).shape == (0, 64)
    with pytest.raises(ValueError, match="one float dtype"):
        gated_rms_norm(x, z.float(), weight, EPS)
    with pytest.raises(ValueError, match="differ"):
        gated_rms_norm(x, z[:, :32], weight, EPS)


def test_prologue_random_table_and_int32_positions() -> None:
    # a table of arbitrary values (not just cos/sin in [-1, 1]) still rounds like torch's rotary
    q, k, v, positions, _, k_cache, v_cache, slots, q_w, k_w = prologue_case(4, 2, 96, tokens=4, dtype=torch.bfloat16)
    case = (q, k, v, positions.to(torch.int32), 2 * torch.randn(2, 4096, 96), k_cache, v_cache, slots, None, None)
    assert_bitwise(fused_prologue(*case), unfused_prologue(*case, kernels=False))


def assert_bitwise(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(out, ref)


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_prologue_bitwise_equal_to_unfused_kernels(shape, dtype: torch.dtype, norm: bool) -> None:
    case = prologue_case(*shape, tokens=5, dtype=dtype, norm=norm)
    k_cache, v_cache, slots = case[5:8]
    outs = fused_prologue(*case)
    assert_bitwise(outs, unfused_prologue(*case))
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    for out, before in zip(outs[1:], (k_cache, v_cache)):
        assert torch.equal(out[untouched], before[untouched])
        assert not torch.equal(out[slots], before[slots])  # written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_prologue_matches_torch_references(shape, dtype: torch.dtype) -> None:
    """Without the norm every op rounds as torch's: bitwise. With it: torch's rotary and index_copy_ on the rms_norm
    kernel's values (which the prologue reproduces) bitwise, and those within rms_norm's tolerance of torch's norm."""
    case = prologue_case(*shape, tokens=6, dtype=dtype, norm=False)
    assert_bitwise(fused_prologue(*case), unfused_prologue(*case, kernels=False))

    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w = prologue_case(*shape, tokens=6, dtype=dtype)
    q_n, k_n = rms_norm(q, q_w, EPS), rms_norm(k, k_w, EPS)
    refs = unfused_prologue(q_n, k_n, v, positions, cos_sin, k_cache, v_cache, slots, None, None, kernels=False)
    assert_bitwise(fused_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w), refs)
    assert_close_to_reference(q_n, norm_reference(q, q_w), dtype)
    assert_close_to_reference(k_n, norm_reference(k, k_w), dtype)


@pytest.mark.parametrize(
    "dtype, cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)], ids=str
)
def test_prologue_casts_to_the_cache_dtype(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    # k and v rounded to the cache's dtype as k.to(cache.dtype) does (nearest even from float32)
    case = prologue_case(4, 2, 96, tokens=5, dtype=dtype, cache_dtype=cache_dtype)
    assert_bitwise(fused_prologue(*case), unfused_prologue(*case))


def test_prologue_views_of_one_projection_and_a_layer_of_the_cache() -> None:
    """q, k, v as views of one fused qkv output (q's head_dim also strided), int32 positions and slots, and the caches
    as one layer of KVCache's [layers, slots, kv_heads, head_dim] pool: the other layers stay as they were."""
    heads, kv_heads, dim, tokens = 4, 2, 64, 7
    q, k, v, positions, cos_sin, _, _, slots, q_w, k_w = prologue_case(heads, kv_heads, dim, tokens, torch.bfloat16)
    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)  # [tokens, (heads + 2 * kv_heads) * dim]
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    pool_k, pool_v = (torch.randn(3, 64, kv_heads, dim).to(torch.bfloat16) for _ in range(2))
    before = pool_k.clone(), pool_v.clone()
    positions, slots = positions.to(torch.int32), slots.to(torch.int32)
    for q_view in (q, q.transpose(1, 2).contiguous().transpose(1, 2)):
        refs = unfused_prologue(q_view, k, v, positions, cos_sin, pool_k[1], pool_v[1], slots.long(), q_w, k_w)
        q_out = attention_prologue(q_view, k, v, positions, cos_sin, pool_k[1], pool_v[1], slots, q_w, k_w, EPS)
        assert_bitwise((q_out, pool_k[1], pool_v[1]), refs)
    for pool, old in zip((pool_k, pool_v), before):
        assert torch.equal(pool[0], old[0]) and torch.equal(pool[2], old[2])


def test_prologue_prefill_sized_batch_and_a_shared_pad_slot() -> None:
    # a prefill's many tokens; then a padded decode batch whose dummy rows all write the pad slot, which then holds
    # padding (one of their rows here; on the GPU their programs race, as index_copy_'s threads do)
    case = prologue_case(4, 2, 32, tokens=40, dtype=torch.bfloat16)
    assert_bitwise(fused_prologue(*case), unfused_prologue(*case))
    q, k, v, positions, cos_sin, k_cache, v_cache, _, q_w, k_w = prologue_case(4, 2, 32, 5, torch.bfloat16)
    pad = 63
    slots = torch.tensor([3, 17, pad, pad, pad])
    _, k_out, v_out = fused_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w)
    _, k_ref, v_ref = unfused_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w)
    assert torch.equal(k_out[:pad], k_ref[:pad]) and torch.equal(v_out[:pad], v_ref[:pad])
    assert any(torch.equal(v_out[pad], v[i]) for i in range(2, 5))


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rotary_dim", [32, 16, 2])  # GLM-4.5's half of the head, Qwen3-Next's quarter, one pair
def test_prologue_partial_rotary(rotary_dim: int, dtype: torch.dtype, norm: bool) -> None:
    """The leading rotary_dim dims of each head turn, the others pass through (their table rows: cos 1, sin 0):
    bitwise the unfused sequence, whose rotary is transformers' partial one (tests/layers/test_rotary.py)."""
    case = prologue_case(4, 2, 64, tokens=5, dtype=dtype, norm=norm, rotary_dim=rotary_dim)
    outs = fused_prologue(*case, rotary_dim=rotary_dim)
    assert_bitwise(outs, unfused_prologue(*case, rotary_dim=rotary_dim))
    full = fused_prologue(*case)  # the same table read whole: the passed-through dims come out alike
    assert torch.equal(outs[0][..., rotary_dim:], full[0][..., rotary_dim:])
    assert not torch.equal(outs[0][..., :rotary_dim], full[0][..., :rotary_dim])


def test_prologue_no_tokens_and_bad_arguments() -> None:
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w = prologue_case(4, 2, 32, 1, torch.float32)
    q, k, v, positions, slots = (t[:0] for t in (q, k, v, positions, slots))
    before = k_cache.clone()
    q_out = attention_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w, EPS)
    assert q_out.shape == (0, 4, 32) and torch.equal(k_cache, before)
    with pytest.raises(ValueError, match="both"):
        attention_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, None, EPS)
    with pytest.raises(ValueError, match="keep q's dtype"):  # float32 weights would promote a bf16 norm
        attention_prologue(q.bfloat16(), k.bfloat16(), v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w, EPS)
    with pytest.raises(ValueError, match="caches"):
        attention_prologue(q, k, v, positions, cos_sin, k_cache[:, :1], v_cache, slots, q_w, k_w, EPS)
    with pytest.raises(ValueError, match="rotary_dim"):
        attention_prologue(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_w, k_w, EPS, rotary_dim=7)
