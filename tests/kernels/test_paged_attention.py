"""Paged decode attention kernel (Triton's interpreter on CPU) against `PagedAttention._decode_torch` and a plain
per-sequence softmax, on fresh random inputs: shuffled block tables padded with a pad block, context lengths on and
off block and split boundaries, MHA / GQA / MQA, block sizes 1 and 16. Small tiles keep several splits (and the reduce
kernel) in play at interpreter-sized contexts; the split length follows each context length: lengths far apart in
one batch, tables padded far past the contexts, more splits than tiles (empty splits, never read), one split.
`choose_splits` against a table and a plain rule (CPU tensors: an H200's SM count); a sequence's output bitwise the
same alone and in batches."""

from __future__ import annotations

import itertools

import pytest
import torch

from edgemoe.context import ForwardContext
from edgemoe.kernels.paged_attention import MAX_SPLITS, STAND_IN_SMS, choose_splits, paged_decode_attention
from edgemoe.layers.attention import PagedAttention
from tests.kernels import interpreter_only

pytestmark = interpreter_only

SPLITS, BLOCK_N = 4, 16  # tests only: at 128 tokens, 4 splits of 2 tiles
LENS = [1, 16, 32, 33, 97, 128]  # one token (3 empty splits), one tile, two, one past, ragged, the full width
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
    attn = PagedAttention(heads, kv_heads, dim)
    attn.bind(c["k_cache"], c["v_cache"], block_size)
    ctx = ForwardContext(False, torch.empty(0, dtype=torch.long), c["context_lens"], c["block_tables"])
    return attn._decode_torch(c["q"], ctx)


def kernel(c: dict, block_size: int, splits: int | None = SPLITS, block_n: int = BLOCK_N) -> torch.Tensor:
    scale = c["q"].shape[2] ** -0.5
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], scale, block_size)
    return paged_decode_attention(*args, splits=splits, block_n=block_n)


def check(c: dict, out: torch.Tensor, block_size: int) -> None:
    heads, kv_heads, dim = c["q"].shape[1], c["k_cache"].shape[1], c["q"].shape[2]
    tol = TOL[c["q"].dtype]
    torch.testing.assert_close(out, torch_decode(c, heads, kv_heads, dim, block_size), **tol)
    torch.testing.assert_close(out.float(), plain_attention(c, dim**-0.5, block_size).float(), **tol)


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
    # one split: no partials, no reduce kernel; whole contexts in one runtime-bounded loop
    c = paged_case([1, 5, 17, 64, 100], 8, 2, 32, block_size, 128, torch.float32)
    check(c, kernel(c, block_size, splits=1), block_size)


def test_narrow_table_gets_the_same_splits() -> None:
    c = paged_case([1, 20, 24], 4, 2, 32, 1, 24, torch.float32)  # 24 tokens: fewer than two tiles of 16
    assert choose_splits(2, STAND_IN_SMS) == 256  # the shapes' S, however narrow the table: all but one empty
    check(c, kernel(c, 1, splits=None), 1)


def test_a_sequence_gets_the_same_output_whatever_its_batch() -> None:
    """Batch invariance: a sequence alone in a table of its own width, and in batches up to 5 beside other contexts
    in tables padded wider (as a graph's), gives bitwise the same output (the splits S and their length follow from
    the shapes and its own context alone)."""
    lens = [150, 3, 97, 512, 33]
    c = paged_case(lens, 8, 2, 32, 16, 512, torch.bfloat16)
    batches = {b: kernel(dict(c, q=c["q"][:b], block_tables=c["block_tables"][:b], context_lens=c["context_lens"][:b]),
                         16, splits=None) for b in range(1, len(lens) + 1)}  # fmt: skip
    for i, n in enumerate(lens):
        blocks = -(-n // 16)
        alone = dict(c, q=c["q"][i : i + 1], block_tables=c["block_tables"][i : i + 1, :blocks],
                     context_lens=c["context_lens"][i : i + 1])  # fmt: skip
        expected = kernel(alone, 16, splits=None)
        for b in range(i + 1, len(lens) + 1):  # every batch it is in
            assert torch.equal(batches[b][i], expected[0]), (i, b)


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
    odd, even = PagedAttention(4, 2, 48), PagedAttention(4, 2, 128)
    for layer in (odd, even):
        layer.use_kernels(torch.device("cuda"))  # what the loader does on a GPU (only the choice: nothing runs)
    assert odd._decode_kernel is None  # the layer keeps the torch path for it
    assert even._decode_kernel is not None


def test_contexts_far_apart_in_a_wide_table() -> None:
    """Splits chosen for the shapes (256, of at least one 16-token tile: 32 hold tokens at 512): one token, a few,
    mid-block, mid-split and the full width in one batch, each split over its own context."""
    lens, width = [1, 3, 24, 150, 512], 512
    assert choose_splits(2, STAND_IN_SMS) == 256
    c = paged_case(lens, 8, 2, 32, 16, width, torch.float32)
    check(c, kernel(c, 16, splits=None), 16)


@pytest.mark.parametrize("splits", [8, 64])
def test_table_padded_far_past_the_contexts(splits: int) -> None:
    """A 4K table over contexts of at most 300 tokens (CUDA graphs pad to the longest context allowed): the splits
    share the contexts, not the width; at 64 splits most are empty."""
    c = paged_case([300, 1, 77, 200], 6, 2, 32, 16, 4096, torch.bfloat16)
    check(c, kernel(c, 16, splits=splits), 16)


@pytest.mark.parametrize("block_size", [1, 16])
def test_more_splits_than_tiles(monkeypatch, block_size: int) -> None:
    """16 splits over contexts of 1 to 3 tiles: the empty splits write nothing and reduce reads only the splits that
    hold tokens (a workspace poisoned with NaN, which any read of an unwritten partial would spread)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(make):
        def make_poisoned(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        return make_poisoned

    c = paged_case([20, 1, 48, 33], 8, 2, 32, block_size, 256, torch.float32)
    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))
    out = kernel(c, block_size, splits=16)
    monkeypatch.undo()
    check(c, out, block_size)


def test_reduce_over_more_than_one_chunk() -> None:
    """256 splits chosen for one KV head, of two 16-token tiles: 125 and 128 of them hold tokens (two of reduce's chunks
    of 64, after a pass over the maxima), one for the one-token context."""
    lens, width = [4000, 1, 4096], 4096
    assert choose_splits(1, STAND_IN_SMS) == 256
    c = paged_case(lens, 4, 1, 16, 16, width, torch.float32)
    check(c, kernel(c, 16, splits=None), 16)


def plain_splits(kv_heads: int, sms: int) -> int:
    """The powers of two up to 256; the first with as many programs as the largest power of two within 4 per SM,
    else the last."""
    target = max(p for p in (2**i for i in range(20)) if p <= 4 * sms)
    return next((s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if kv_heads * s >= target), 256)


@pytest.mark.parametrize(
    "kv_heads, expected",
    [
        (4, 128),  # qwen3-30b-a3b (4 KV heads): 512 programs at batch 1 (132 SMs: 4 x 132 -> 512)
        (16, 32),  # qwen1.5-moe (16 KV heads)
        (8, 64),  # mixtral
        (1, MAX_SPLITS),
        (1024, 1),
    ],
)
def test_choose_splits_cases(kv_heads: int, expected: int) -> None:
    assert choose_splits(kv_heads, 132) == expected


def test_choose_splits_matches_the_plain_rule() -> None:
    for kv_heads, sms in itertools.product((1, 2, 4, 8, 16, 64, 512, 4096), (1, 78, 132)):
        assert choose_splits(kv_heads, sms) == plain_splits(kv_heads, sms)


def test_min_split_tiles() -> None:
    """Two-tile splits where half the splits still cover every SM (qwen3: 4 KV heads x 128 splits on 132 SMs),
    one-tile ones where they would not (one KV head); the far-apart-contexts case above runs the two-tile rule
    through the kernel (2 x 256 programs a sequence)."""
    from edgemoe.kernels.paged_attention import min_split_tiles

    assert min_split_tiles(4, 128, 132) == 2
    assert min_split_tiles(1, 256, 132) == 1
    assert min_split_tiles(2, 256, STAND_IN_SMS) == 2
