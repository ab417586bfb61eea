"""Paged decode attention with a sliding window and attention sinks (gpt-oss, Gemma-4's sliding layers), Triton's
interpreter on CPU, against the layer's plain-torch reference (`PagedAttention._decode_torch`: `visible`'s window,
`sink_attention`) and a float64 per-sequence softmax over the window's keys and the sink, on fresh random inputs:
window only, sinks only, both; MHA, GQA, a padded group; contexts shorter than the window, on and off block and tile
boundaries around it, far longer; windows on and off a tile boundary; float32 and bfloat16; one split, several,
more than reduce takes in one round trip; padding rows of a captured batch (one token in the pad block). The kernel
reads no token before the window; a window past every context and sinks at -inf give bitwise the kernel without
them; the layer takes the kernel for these layers on CUDA; a sequence's output is bitwise the same in any batch."""

from __future__ import annotations

import pytest
import torch

from edgemoe.context import ForwardContext
from edgemoe.kernels.paged_attention import paged_decode_attention
from edgemoe.layers.attention import PagedAttention
from edgemoe.layers.kernels import select_kernels
from tests.kernels import interpreter_only
from tests.kernels.test_paged_attention import BLOCK_N, SPLITS, TOL, paged_case

pytestmark = interpreter_only

BS = 16  # block size
# one token, under the window, one block, around a 20- and a 32-token window, two tiles, far past it
LENS = [1, 15, 16, 17, 20, 21, 31, 32, 33, 48, 100, 250]
WIDTH = 256
SHAPES = [(8, 2, 32), (4, 4, 32), (6, 2, 32)]  # GQA, MHA, GQA group 3 (padded rows)


def layer(c: dict, window: int | None, sinks: bool, sink_dtype=torch.float32) -> PagedAttention:
    """The layer over `c`'s cache; sinks around the scores' scale (x2 q: scores of a few units), some far above."""
    heads, kv_heads, dim = c["q"].shape[1], c["k_cache"].shape[1], c["q"].shape[2]
    attn = PagedAttention(heads, kv_heads, dim, window, sinks)
    if sinks:
        attn.sinks.data = (torch.randn(heads) * 2 + torch.arange(heads) % 3).to(sink_dtype)
    attn.bind(c["k_cache"], c["v_cache"], BS)
    return attn


def ctx_of(c: dict) -> ForwardContext:
    return ForwardContext(False, torch.empty(0, dtype=torch.long), c["context_lens"], c["block_tables"])


def kernel(c: dict, attn: PagedAttention, splits: int | None = SPLITS, block_n: int = BLOCK_N) -> torch.Tensor:
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], attn.scale, BS)
    return paged_decode_attention(*args, window=attn.window, sinks=attn.sinks, splits=splits, block_n=block_n)


def plain(c: dict, attn: PagedAttention) -> torch.Tensor:
    """Per sequence, its window's tokens only and the sink as one more logit, float64 -> [seqs, heads, dim]."""
    heads, kv_heads = c["q"].shape[1], c["k_cache"].shape[1]
    out = []
    for i, n in enumerate(c["context_lens"].tolist()):
        t = torch.arange(max(0, n - attn.window) if attn.window else 0, n)
        slots = c["block_tables"][i, t // BS] * BS + t % BS
        k = c["k_cache"][slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [keys, heads, dim]
        v = c["v_cache"][slots].double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", c["q"][i].double(), k) * attn.scale  # [heads, keys]
        if attn.sinks is not None:
            s = torch.cat([s, attn.sinks.double()[:, None]], dim=1)
        p = s.softmax(-1)[:, : len(t)]
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def check(c: dict, attn: PagedAttention, out: torch.Tensor) -> None:
    """Against the float64 softmax at the dtype's tolerance; against the layer's reference too, which with sinks in
    bfloat16 rounds its scores and probabilities to bfloat16 as transformers' eager attention does (up to 0.03 off
    the float64 softmax here, where the kernel's float32 stays within 0.015): twice the tolerance there."""
    tol = TOL[c["q"].dtype]
    assert out.shape == c["q"].shape and out.dtype == c["q"].dtype
    torch.testing.assert_close(out.double(), plain(c, attn), **tol)
    loose = attn.sinks is not None and c["q"].dtype == torch.bfloat16
    ref_tol = {k: 2 * v for k, v in tol.items()} if loose else tol
    torch.testing.assert_close(out, attn._decode_torch(c["q"], ctx_of(c)), **ref_tol)


VARIANTS = {"window": (32, False), "sinks": (None, True), "both": (32, True), "both-off-tile": (20, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_references(variant: str, shape, dtype) -> None:
    c = paged_case(LENS, *shape, BS, WIDTH, dtype)
    attn = layer(c, *VARIANTS[variant], sink_dtype=dtype)  # the model's dtype, as the loader leaves them
    check(c, attn, kernel(c, attn))


def test_padded_group_and_float32_sinks_with_bfloat16() -> None:
    c = paged_case(LENS, *SHAPES[2], BS, WIDTH, torch.bfloat16)
    attn = layer(c, 20, True)
    check(c, attn, kernel(c, attn))


@pytest.mark.parametrize("splits", [1, 128, None])  # the output written by the partials; reduce in chunks; chosen
def test_splits(splits: int | None) -> None:
    """Windows over contexts of 1 to 1000 tokens in a 1K table: the splits share the window's tiles (most empty at
    128 and at the 256 chosen for two KV heads; above 64 reduce takes them in chunks, after the maxima)."""
    c = paged_case([1, 40, 129, 1000, 513], 8, 2, 32, BS, 1024, torch.float32)
    attn = layer(c, 100, True)
    check(c, attn, kernel(c, attn, splits=splits))


def test_reads_nothing_before_the_window() -> None:
    """Every token before a sequence's window, its blocks' unused tail and the pad block poisoned with NaN: the
    gather-and-mask reference would spread it (0 x NaN); the kernel reads none of them, so its output matches the
    float64 softmax over the window."""
    window = 20
    c = paged_case([5, 33, 64, 250], 8, 2, 32, BS, WIDTH, torch.float32)
    for i, n in enumerate(c["context_lens"].tolist()):
        before = torch.arange(max(0, n - window))
        tail = torch.arange(n, -(-n // BS) * BS)
        for t in (before, tail):
            slots = c["block_tables"][i, t // BS] * BS + t % BS
            c["k_cache"][slots], c["v_cache"][slots] = float("nan"), float("nan")
    for cache in (c["k_cache"], c["v_cache"]):
        cache[c["pad_block"] * BS :] = float("nan")
    attn = layer(c, window, True)
    for splits in (SPLITS, 1):
        out = kernel(c, attn, splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), plain(c, attn), **TOL[torch.float32])


@pytest.mark.parametrize("splits", [SPLITS, 1])  # (the chunked reduce's branch: test_splits[128])
def test_neutral_window_and_sinks_change_nothing(splits: int) -> None:
    """A window no context reaches and sinks at -inf (exp = 0) through their branches give bitwise the kernel
    without either, which tests/kernels/test_paged_attention.py checks against the references."""
    c = paged_case(LENS, 8, 2, 32, BS, WIDTH, torch.bfloat16)
    bare = layer(c, None, False)
    neutral = layer(c, WIDTH, True)
    neutral.sinks.data.fill_(float("-inf"))
    assert torch.equal(kernel(c, neutral, splits), kernel(c, bare, splits))


def test_padding_rows_of_a_captured_batch() -> None:
    """A graph's padding rows: one token in the pad block (which padding rows write), its whole table the pad block.
    They give that token's value; the real rows are bitwise as without them."""
    c = paged_case([70, 3, 250], 8, 2, 32, BS, WIDTH, torch.bfloat16)
    attn = layer(c, 32, True, torch.bfloat16)
    real = kernel(c, attn, splits=None)
    rows = 5
    pad = dict(c)
    pad["q"] = torch.cat([c["q"], (2 * torch.randn(rows - 3, 8, 32)).bfloat16()])
    pad["block_tables"] = torch.cat([c["block_tables"], torch.full((rows - 3, WIDTH // BS), c["pad_block"])])
    pad["context_lens"] = torch.tensor([70, 3, 250, 1, 1])
    out = kernel(pad, attn, splits=None)
    assert torch.equal(out[:3], real)
    check(pad, attn, out)


def test_a_sequence_gets_the_same_output_whatever_its_batch() -> None:
    lens = [250, 3, 97]  # each alone, then in every batch it is in
    c = paged_case(lens, 8, 2, 32, BS, WIDTH, torch.bfloat16)
    attn = layer(c, 40, True)
    batches = {b: kernel(dict(c, q=c["q"][:b], block_tables=c["block_tables"][:b], context_lens=c["context_lens"][:b]),
                         attn, splits=None) for b in range(1, len(lens) + 1)}  # fmt: skip
    for i, n in enumerate(lens):
        alone = dict(c, q=c["q"][i : i + 1], block_tables=c["block_tables"][i : i + 1, : -(-n // BS)],
                     context_lens=c["context_lens"][i : i + 1])  # fmt: skip
        expected = kernel(alone, attn, splits=None)
        for b in range(i + 1, len(lens) + 1):
            assert torch.equal(batches[b][i], expected[0]), (i, b)


def test_the_layer_takes_the_kernel_on_cuda_only() -> None:
    """What the loader does (`select_kernels`): on a CUDA device the windowed and sink layers decode with the kernel
    (given their window and sinks), on the CPU they keep the reference."""
    from edgemoe.kernels.paged_attention import BLOCK_N as ENGINE_BLOCK_N

    c = paged_case([1, 30, 100], 8, 2, 32, BS, 128, torch.float32)
    for window, sinks in VARIANTS.values():
        cpu = layer(c, window, sinks)
        assert not select_kernels(cpu, torch.device("cpu")) and cpu._decode_kernel is None
        cuda = layer(c, window, sinks)
        if sinks:
            cuda.sinks.data = cpu.sinks.data
        select_kernels(cuda, torch.device("cuda"))  # only the choice: nothing runs on a GPU
        assert cuda._decode_kernel is paged_decode_attention
        if (window, sinks) != VARIANTS["both-off-tile"]:
            continue  # (the interpreter is slow: one variant through the layer's kernel path)
        out = cuda._decode(c["q"], ctx_of(c))
        assert torch.equal(out, kernel(c, cuda, splits=None, block_n=ENGINE_BLOCK_N))
        torch.testing.assert_close(out, cpu._decode(c["q"], ctx_of(c)), **TOL[torch.float32])


def test_bad_window_or_sinks_are_refused() -> None:
    c = paged_case([4], 4, 2, 32, BS, 16, torch.float32)
    attn = layer(c, None, False)
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], attn.scale, BS)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(*args, window=0)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(*args, sinks=torch.zeros(2))
