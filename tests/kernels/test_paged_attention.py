"""Paged decode attention kernel (Triton's interpreter on CPU) against `PagedAttention._decode_torch` and a plain
per-sequence softmax, on fresh random inputs: shuffled block tables padded with a pad block, context lengths on and
off block and partition boundaries, MHA / GQA / MQA, block sizes 1 and 16. Small partitions keep several splits
(and the reduce kernel) in play at interpreter-sized contexts."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.context import ForwardContext
from edgemoe.kernels.paged_attention import paged_decode_attention
from edgemoe.layers.attention import PagedAttention

PARTITION, BLOCK_N = 32, 16  # tests only: 4 splits over a 128-token width
LENS = [1, 16, 32, 33, 97, 128]  # one token, one tile, one partition, one past it, ragged, the full width
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def paged_case(lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, width: int, dtype) -> dict:
    """Random q and cache; each sequence gets its blocks from one shuffled permutation (non-contiguous, in no
    order), its table padded with the pad block (the cache's last, like KVCache) up to `width` tokens."""
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 3  # spare blocks nobody reads
    perm = torch.randperm(num_blocks)
    tables = torch.full((len(lens), width // block_size), num_blocks, dtype=torch.long)
    start = 0
    for i, n in enumerate(used):
        tables[i, :n] = perm[start : start + n]
        start += n
    slots = (num_blocks + 1) * block_size
    return dict(
        q=(2 * torch.randn(len(lens), heads, dim)).to(dtype),  # x2: a peakier softmax
        k_cache=torch.randn(slots, kv_heads, dim).to(dtype),
        v_cache=torch.randn(slots, kv_heads, dim).to(dtype),
        block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.long),
        pad_block=num_blocks,
    )


def plain_attention(c: dict, scale: float, block_size: int) -> torch.Tensor:
    """Per sequence: its own tokens only, in float64 -> [seqs, heads, dim] float64."""
    heads, kv_heads = c["q"].shape[1], c["k_cache"].shape[1]
    out = []
    for i, n in enumerate(c["context_lens"].tolist()):
        t = torch.arange(n)
        slots = c["block_tables"][i, t // block_size] * block_size + t % block_size  # [n]
        k = c["k_cache"][slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, dim]
        v = c["v_cache"][slots].double().repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", c["q"][i].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def torch_decode(c: dict, heads: int, kv_heads: int, dim: int, block_size: int) -> torch.Tensor:
    attn = PagedAttention(heads, kv_heads, dim, block_size)
    attn.k_cache, attn.v_cache = c["k_cache"], c["v_cache"]
    ctx = ForwardContext(False, torch.empty(0, dtype=torch.long), c["context_lens"], c["block_tables"])
    return attn._decode_torch(c["q"], ctx)


def kernel(c: dict, block_size: int, partition: int = PARTITION) -> torch.Tensor:
    scale = c["q"].shape[2] ** -0.5
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], scale, block_size)
    return paged_decode_attention(*args, partition=partition, block_n=BLOCK_N)


SHAPES = [(4, 4, 32), (8, 2, 64), (6, 2, 32), (16, 1, 32)]  # MHA, GQA, GQA group 3 (padded), MQA group 16


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_float32_matches_references(shape, block_size) -> None:
    heads, kv_heads, dim = shape
    c = paged_case(LENS, heads, kv_heads, dim, block_size, 128, torch.float32)
    out = kernel(c, block_size)
    assert out.shape == c["q"].shape and out.dtype == torch.float32
    torch.testing.assert_close(out, torch_decode(c, heads, kv_heads, dim, block_size), **TOL[torch.float32])
    expected = plain_attention(c, dim**-0.5, block_size).float()
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4, 4, 32), (8, 2, 64)], ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_half_precision_matches_references(shape, dtype) -> None:
    heads, kv_heads, dim = shape
    c = paged_case(LENS, heads, kv_heads, dim, 16, 128, dtype)
    out = kernel(c, 16)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch_decode(c, heads, kv_heads, dim, 16), **TOL[dtype])
    torch.testing.assert_close(out.float(), plain_attention(c, dim**-0.5, 16).float(), **TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 16])
def test_one_split_writes_the_output_directly(block_size) -> None:
    # width <= partition: no partials, no reduce kernel
    c = paged_case([1, 5, 17, 64], 8, 2, 32, block_size, 64, torch.float32)
    out = kernel(c, block_size, partition=64)
    torch.testing.assert_close(out, torch_decode(c, 8, 2, 32, block_size), **TOL[torch.float32])


def test_reads_nothing_past_the_context() -> None:
    # poisoned pad block and tail slots: the gather-and-mask reference would turn them into NaN (0 * NaN)
    c = paged_case([3, 20, 45], 8, 2, 32, 16, 96, torch.float32)
    for i, n in enumerate(c["context_lens"].tolist()):
        last = c["block_tables"][i, (n - 1) // 16]
        for cache in (c["k_cache"], c["v_cache"]):
            cache[last * 16 + (n - 1) % 16 + 1 : (last + 1) * 16] = float("nan")  # the last block's unused slots
            cache[c["pad_block"] * 16 :] = float("nan")
    out = kernel(c, 16)
    torch.testing.assert_close(out, plain_attention(c, 32**-0.5, 16).float(), **TOL[torch.float32])


def test_strided_query() -> None:
    c = paged_case([7, 40], 4, 2, 32, 16, 64, torch.float32)
    wide = torch.randn(2, 4, 3 * 32)
    wide[:, :, 32:64] = c["q"]
    c["q"] = wide[:, :, 32:64]  # [seqs, heads, dim] with row and head strides of a fused qkv
    torch.testing.assert_close(kernel(c, 16), torch_decode(c, 4, 2, 32, 16), **TOL[torch.float32])


def test_unsupported_head_dim_is_refused() -> None:
    c = paged_case([4], 4, 2, 48, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        kernel(c, 16)
    assert not PagedAttention(4, 2, 48, 16).fused_decode  # the layer keeps the torch path for it
    assert PagedAttention(4, 2, 128, 16).fused_decode
