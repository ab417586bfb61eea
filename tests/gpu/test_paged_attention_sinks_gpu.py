"""Paged decode attention with a sliding window and attention sinks compiled on CUDA, at the shapes that use them:
gpt-oss's (64 / 8 / 64, window 128, sinks), Gemma-4's sliding layers (8 / 4 / 256, window 512, scaling 1) and a
GQA layer with both. Against the layer's reference (`PagedAttention._decode_torch`) and a float64 per-sequence
softmax over the window's keys and the sink, contexts from one token to 32K in a 40K table, float32 and bf16, the
splits `choose_splits` picks and forced ones; no token before the window is read (NaN there changes nothing); no host
synchronisation; the layer's kernel path; replayed from a CUDA graph with new lengths, tables, cache contents and
sinks, padding rows included; a sequence's output bitwise the same in any batch."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.layers.attention import PagedAttention
from tests.gpu.sync_free import host_sync_forbidden
from tests.gpu.test_paged_attention_gpu import TOL, decode_ctx, fill_tables, paged_case

# (heads, kv_heads, head_dim, window, sinks, scale): gpt-oss, Gemma-4's sliding layers, a GQA layer with both
LAYERS = {
    "gpt-oss": (64, 8, 64, 128, True, None),
    "gemma4-sliding": (8, 4, 256, 512, False, 1.0),
    "gqa-both": (32, 4, 128, 1000, True, None),
}
LENS = [1, 15, 127, 128, 129, 511, 512, 513, 4096, 32768]  # around the windows, block and tile boundaries
WIDTH = 40960


def layer(k: torch.Tensor, v: torch.Tensor, heads: int, window: int, sinks: bool, scale: float | None, seed: int = 0):
    attn = PagedAttention(heads, k.shape[1], k.shape[2], window, sinks).cuda()
    if scale is not None:
        attn.scale = scale
    if sinks:  # around the scores' scale, some far above them
        gen = torch.Generator(device="cuda").manual_seed(seed)
        attn.sinks.data = 2 * torch.randn(heads, generator=gen, device="cuda") + torch.arange(heads, device="cuda") % 3
    attn.use_kernels(k.device)  # as the loader chooses for a CUDA device
    attn.bind(k, v, 16)
    return attn


def plain(q, k_cache, v_cache, tables, lens, attn: PagedAttention) -> torch.Tensor:
    """Per sequence, its window's tokens and the sink as one more logit, float64 -> [seqs, heads, dim] float64."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for i, n in enumerate(lens.tolist()):
        t = torch.arange(max(0, n - attn.window), n, device=q.device)
        slots = tables[i, t // attn.block_size] * attn.block_size + t % attn.block_size
        k = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [keys, heads, dim]
        v = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * attn.scale
        if attn.sinks is not None:
            s = torch.cat([s, attn.sinks.double()[:, None]], dim=1)
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1)[:, : len(t)], v))
    return torch.stack(out)


def kernel(attn: PagedAttention, q, tables, lens, **opts) -> torch.Tensor:
    from edgemoe.kernels.paged_attention import paged_decode_attention

    args = (q, attn.k_cache, attn.v_cache, tables, lens, attn.scale, attn.block_size)
    return paged_decode_attention(*args, window=attn.window, sinks=attn.sinks, **opts)


def unscaled(attn: PagedAttention, dtype) -> bool:
    """A float32 layer that does not scale its scores (Gemma-4's scale 1 over 256 dims): scores 16x larger, so the
    softmax's float32 rounding is larger too (seen on an H100: up to 6.2e-5 over 40,960 tokens, a few elements of
    20,480, against the float64 reference and against torch's float32 path alike)."""
    return attn.scale == 1.0 and dtype == torch.float32


def exact_tol(attn: PagedAttention, dtype) -> dict:
    """Against the float64 reference: float32's tolerance x4 for an unscaled layer."""
    return {k: 4 * v for k, v in TOL[dtype].items()} if unscaled(attn, dtype) else TOL[dtype]


def ref_tol(attn: PagedAttention, dtype) -> dict:
    """Against the layer's torch path: x2 where it rounds scores and probabilities to bf16 (transformers' eager
    attention with sinks), x4 for an unscaled float32 layer."""
    if unscaled(attn, dtype):
        return {k: 4 * v for k, v in TOL[dtype].items()}
    loose = attn.sinks is not None and dtype == torch.bfloat16
    return {k: 2 * v for k, v in TOL[dtype].items()} if loose else TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", LAYERS)
def test_matches_references(name: str, dtype) -> None:
    from edgemoe.kernels.paged_attention import MAX_SPLITS

    heads, kv_heads, dim, *rest = LAYERS[name]
    q, k, v, tables, lens = paged_case(LENS, heads, kv_heads, dim, 16, WIDTH, dtype, seed=dim)
    attn = layer(k, v, heads, *rest)
    expected = plain(q, k, v, tables, lens, attn)
    for splits in (None, 1, 8, MAX_SPLITS):
        out = kernel(attn, q, tables, lens, splits=splits)
        assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(
            out.double(), expected, **exact_tol(attn, dtype), msg=lambda m, s=splits: f"S={s}: {m}"
        )
    out = attn._decode(q, decode_ctx(tables, lens))  # the layer's path: the kernel with its window and sinks
    assert torch.equal(out, kernel(attn, q, tables, lens))
    torch.testing.assert_close(out, attn._decode_torch(q, decode_ctx(tables, lens)), **ref_tol(attn, dtype))


def test_reads_nothing_before_the_window() -> None:
    """NaN in every slot before each window (and in the pad block): the kernel reads none of them."""
    heads, kv_heads, dim, *rest = LAYERS["gpt-oss"]
    lens = [32768, 129, 4000, 5]
    q, k, v, tables, ctx_lens = paged_case(lens, heads, kv_heads, dim, 16, WIDTH, torch.bfloat16, seed=3)
    attn = layer(k, v, heads, *rest)
    for i, n in enumerate(lens):
        t = torch.arange(max(0, n - attn.window), device="cuda")
        slots = tables[i, t // 16] * 16 + t % 16
        k[slots], v[slots] = float("nan"), float("nan")
    k[-16:], v[-16:] = float("nan"), float("nan")
    out = kernel(attn, q, tables, ctx_lens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), plain(q, k, v, tables, ctx_lens, attn), **TOL[torch.bfloat16])


def test_does_not_synchronise() -> None:
    heads, kv_heads, dim, *rest = LAYERS["gpt-oss"]
    q, k, v, tables, lens = paged_case([3000, 40], heads, kv_heads, dim, 16, 8192, torch.bfloat16, seed=1)
    attn = layer(k, v, heads, *rest)
    kernel(attn, q, tables, lens)  # compiles (may sync)
    with host_sync_forbidden():
        kernel(attn, q, tables, lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["gpt-oss", "gemma4-sliding"])
def test_cuda_graph_replays_new_lengths_tables_and_sinks(name: str, dtype) -> None:
    """Captured once at a 40K width with one-token contexts, as decode's graphs; each replay gets new q, cache
    contents, block tables, context lengths and sinks (the parameter, updated in place), the last rows padding (one
    token in the pad block, as `DecodeBuffers` writes them)."""
    heads, kv_heads, dim, *rest = LAYERS[name]
    seqs, bs = 4, 16
    num_blocks = seqs * WIDTH // bs
    k = torch.zeros((num_blocks + 1) * bs, kv_heads, dim, dtype=dtype, device="cuda")
    v = torch.zeros_like(k)
    q = torch.zeros(seqs, heads, dim, dtype=dtype, device="cuda")
    tables = torch.full((seqs, WIDTH // bs), num_blocks, dtype=torch.long, device="cuda")
    lens = torch.ones(seqs, dtype=torch.long, device="cuda")
    attn = layer(k, v, heads, *rest)
    graph, out = capture_graph(lambda: attn._decode(q, decode_ctx(tables, lens)))
    gen = torch.Generator().manual_seed(0)
    rounds = ([1, 512, 513, 40960], [4096, 17, 1, 1], [40960] * 4, [127, 128, 129, 1], [32768, 4097, 65, 64])
    for r, round_lens in enumerate(rounds):
        q.copy_(2 * torch.randn(q.shape, generator=gen))
        k.normal_()
        v.normal_()
        real = [n for n in round_lens if n > 1] if r == 1 else round_lens  # round 1: two padding rows
        fill_tables(tables, real, bs, num_blocks, gen)
        lens.copy_(torch.tensor(round_lens))
        if attn.sinks is not None:
            attn.sinks.data.copy_(3 * torch.randn(heads, generator=gen))
        graph.replay()
        msg = lambda m, rl=round_lens: f"lens {rl}: {m}"  # noqa: E731
        torch.testing.assert_close(out.double(), plain(q, k, v, tables, lens, attn), **exact_tol(attn, dtype), msg=msg)
        expected = attn._decode_torch(q, decode_ctx(tables, lens))
        torch.testing.assert_close(out, expected, **ref_tol(attn, dtype), msg=msg)


def test_a_sequence_gets_the_same_output_whatever_its_batch() -> None:
    """Alone in a table of its own width, and in batches beside other contexts in a graph's 40K table: bitwise the
    same (the window's splits follow from its own context)."""
    heads, kv_heads, dim, *rest = LAYERS["gpt-oss"]
    lens = [32768, 3, 129, 4096, 128]
    q, k, v, tables, ctx_lens = paged_case(lens, heads, kv_heads, dim, 16, WIDTH, torch.bfloat16, seed=5)
    attn = layer(k, v, heads, *rest)
    for i, n in enumerate(lens):
        expected = kernel(attn, q[i : i + 1], tables[i : i + 1, : -(-n // 16)], ctx_lens[i : i + 1])
        for b in range(i + 1, len(lens) + 1):
            assert torch.equal(kernel(attn, q[:b], tables[:b], ctx_lens[:b])[i], expected[0]), (i, b)
