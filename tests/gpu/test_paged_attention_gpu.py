"""Paged decode attention (`edgemoe.kernels.paged_attention`) compiled on CUDA: against `PagedAttention._decode_torch`
and a float64 per-sequence softmax at real shapes up to a 40K padded width (qwen3's max_model_len), in float32 and
bf16, with the splits `choose_splits` picks for this GPU (128 at batch 1 on an H200) and with forced ones (1, a few,
the most); the layer's decode path; no host synchronisation; offsets past int32 in a large cache; replayed from a CUDA
graph with new context lengths, block tables and cache contents (the split length follows the new lengths)."""

from __future__ import annotations

import pytest
import torch

from edgemoe.context import ForwardContext
from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.layers.attention import PagedAttention
from tests.gpu.sync_free import host_sync_forbidden

SHAPES = [(16, 16, 128), (32, 4, 128), (4, 1, 64)]  # (heads, kv_heads, head_dim): MHA, GQA 8, MQA
LENS = [1, 15, 511, 512, 513, 4096, 20000, 32768]  # on and off block and tile boundaries
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def fill_tables(tables: torch.Tensor, lens: list[int], block_size: int, num_blocks: int, gen) -> None:
    """Each sequence's blocks from one shuffled permutation of the cache (in no order); the rest: the pad block."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    rows = torch.full(tables.shape, num_blocks, dtype=torch.long)
    start = 0
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        rows[i, :used] = torch.tensor(perm[start : start + used])
        start += used
    tables.copy_(rows)


def paged_case(lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, width: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    slots = (num_blocks + 1) * block_size  # + the pad block, last (as KVCache)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (2 * torch.randn(len(lens), heads, dim, generator=g, device="cuda")).to(dtype)
    k = torch.randn(slots, kv_heads, dim, generator=g, device="cuda").to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=g, device="cuda").to(dtype)
    tables = torch.empty(len(lens), width // block_size, dtype=torch.long, device="cuda")
    fill_tables(tables, lens, block_size, num_blocks, gen)
    return q, k, v, tables, torch.tensor(lens, device="cuda")


def layer_with(k: torch.Tensor, v: torch.Tensor, heads: int, block_size: int) -> PagedAttention:
    attn = PagedAttention(heads, k.shape[1], k.shape[2])
    attn.use_kernels(k.device)  # as the loader chooses for a CUDA device
    attn.bind(k, v, block_size)
    return attn


def decode_ctx(tables: torch.Tensor, lens: torch.Tensor) -> ForwardContext:
    return ForwardContext(False, torch.empty(0, dtype=torch.long, device="cuda"), lens, tables)


def plain_attention(q, k_cache, v_cache, tables, lens, block_size: int) -> torch.Tensor:
    """Per sequence, its own tokens only, float64 -> [seqs, heads, dim] float64."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    out = []
    for i, n in enumerate(lens.tolist()):
        t = torch.arange(n, device=q.device)
        slots = tables[i, t // block_size] * block_size + t % block_size
        k = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, dim]
        v = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), k) * dim**-0.5).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("width, block_size", [(40960, 16), (512, 16), (2048, 1), (64, 16)])  # 64: one split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_matches_references(shape, dtype, width: int, block_size: int) -> None:
    from edgemoe.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, dim = shape
    lens = [n for n in LENS if n <= width] + [width]
    q, k, v, tables, ctx_lens = paged_case(lens, heads, kv_heads, dim, block_size, width, dtype, seed=len(lens))
    attn = layer_with(k, v, heads, block_size)
    out = paged_decode_attention(q, k, v, tables, ctx_lens, attn.scale, block_size)  # the chosen splits
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, attn._decode_torch(q, decode_ctx(tables, ctx_lens)), **TOL[dtype])
    torch.testing.assert_close(out.double(), plain_attention(q, k, v, tables, ctx_lens, block_size), **TOL[dtype])
    torch.testing.assert_close(attn._decode(q, decode_ctx(tables, ctx_lens)), out, atol=0, rtol=0)  # the layer's path


@pytest.mark.parametrize(
    "lens, width",
    [([4096], 40960), ([32768], 40960), ([4096, 1, 40960, 2500], 40960), ([4095], 4096), ([4096, 1, 3001, 17], 4096)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_splits_at_qwen3_shape(lens: list[int], width: int, dtype) -> None:
    """qwen3-30b-a3b's 32 / 4 / 128 at batch 1 and 4: the chosen splits, one split, a few, and the most (mostly
    empty at 4K in a 40K table), all against the references."""
    from edgemoe.kernels.paged_attention import MAX_SPLITS, choose_splits, paged_decode_attention

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = choose_splits(4, sms)
    q, k, v, tables, ctx_lens = paged_case(lens, 32, 4, 128, 16, width, dtype, seed=lens[0])
    attn = layer_with(k, v, 32, 16)
    expected = plain_attention(q, k, v, tables, ctx_lens, 16)
    for splits in (None, chosen, 1, 8, MAX_SPLITS):
        out = paged_decode_attention(q, k, v, tables, ctx_lens, attn.scale, 16, splits=splits)
        torch.testing.assert_close(out.double(), expected, **TOL[dtype], msg=lambda m, s=splits: f"S={s}: {m}")
    torch.testing.assert_close(out, attn._decode_torch(q, decode_ctx(tables, ctx_lens)), **TOL[dtype])


def test_does_not_synchronise() -> None:
    from edgemoe.kernels.paged_attention import paged_decode_attention

    q, k, v, tables, lens = paged_case([3000, 40], 32, 4, 128, 16, 8192, torch.bfloat16, seed=1)
    paged_decode_attention(q, k, v, tables, lens, 128**-0.5, 16)  # compiles (may sync)
    with host_sync_forbidden():
        paged_decode_attention(q, k, v, tables, lens, 128**-0.5, 16)


def test_offsets_past_int32() -> None:
    """A cache of more than 2^31 elements, the sequences' blocks at its end: slot * stride needs int64."""
    from edgemoe.kernels.paged_attention import paged_decode_attention

    kv_heads, dim, bs = 8, 128, 16
    num_blocks = 2**31 // (kv_heads * dim * bs) + 64
    k = torch.empty((num_blocks + 1) * bs, kv_heads, dim, dtype=torch.bfloat16, device="cuda")  # 4.3 GB each
    v = torch.empty_like(k)
    for cache in (k, v):
        cache[(num_blocks - 64) * bs :].normal_()  # the blocks read, and the pad block (never read)
    top = (num_blocks - 64 + torch.randperm(64)).cuda()  # the last 64 blocks, shuffled
    tables = torch.full((2, 128), num_blocks, dtype=torch.long, device="cuda")  # a 2048-token width
    tables[0, :63], tables[1, :44] = top[:63], top[20:]  # 1000 and 700 tokens (shared blocks: reads only)
    lens = torch.tensor([1000, 700], device="cuda")
    q = torch.randn(2, 32, dim, device="cuda").bfloat16()
    out = paged_decode_attention(q, k, v, tables, lens, dim**-0.5, bs)
    torch.testing.assert_close(out.double(), plain_attention(q, k, v, tables, lens, bs), **TOL[torch.bfloat16])


@pytest.mark.parametrize("seqs", [1, 4])  # on an H200: 128 and 32 splits
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_lengths_and_tables(dtype, seqs: int) -> None:
    """Captured once at a 40K width with one-token contexts; each replay gets new q, cache contents, block tables
    and context lengths (one token to the full width) written into the static buffers. A split length frozen at
    capture (64 tokens) would miss tokens of the long contexts; partials left by a long round would spoil a short
    one if reduce read past the splits this round wrote."""
    from edgemoe.kernels.paged_attention import paged_decode_attention

    heads, kv_heads, dim, bs, width = 32, 4, 128, 16, 40960
    num_blocks = seqs * width // bs  # room for every sequence at the full width
    k = torch.zeros((num_blocks + 1) * bs, kv_heads, dim, dtype=dtype, device="cuda")
    v = torch.zeros_like(k)
    q = torch.zeros(seqs, heads, dim, dtype=dtype, device="cuda")
    tables = torch.full((seqs, width // bs), num_blocks, dtype=torch.long, device="cuda")
    lens = torch.ones(seqs, dtype=torch.long, device="cuda")
    attn = layer_with(k, v, heads, bs)

    def step() -> torch.Tensor:
        return paged_decode_attention(q, k, v, tables, lens, attn.scale, bs)

    graph, out = capture_graph(step)
    gen = torch.Generator().manual_seed(0)
    rounds = (
        [1, 1, 1, 1],
        [1, 512, 513, 40960],
        [4096, 17, 40959, 1000],
        [40960] * 4,
        [3, 2, 1, 600],
        [4096] * 4,
        [32768, 4097, 65, 64],
    )
    for round_lens in (r[-seqs:] for r in rounds):
        q.copy_(2 * torch.randn(q.shape, generator=gen))
        k.normal_()
        v.normal_()
        fill_tables(tables, round_lens, bs, num_blocks, gen)
        lens.copy_(torch.tensor(round_lens))
        graph.replay()
        expected = attn._decode_torch(q, decode_ctx(tables, lens))
        torch.testing.assert_close(out, expected, **TOL[dtype], msg=lambda m, r=round_lens: f"lens {r}: {m}")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL and the prefetch: sm_90+"
)
@pytest.mark.parametrize("seqs", [1, 4])
def test_kv_prefetch_changes_nothing(monkeypatch, seqs: int) -> None:
    """Replayed from a CUDA graph as decode runs them (the qkv GEMV -> the attention prologue -> paged attention),
    with new x, caches, tables and lengths each round: the prologue letting attention be scheduled before it waits
    for qkv (three kernels in flight), and attention asking L2 for 0, 1, 2 or 4 tiles of K/V before its own wait,
    give bitwise the output and caches of neither, which match the reference. A prologue that let attention read q
    or the newest K/V row before they were written would show here as a wrong output."""
    from edgemoe.kernels import norm_rope, paged_attention
    from edgemoe.kernels.dense_gemv import gemv
    from edgemoe.layers.rotary import RotaryEmbedding

    heads, kv_heads, dim, bs, width, hidden = 32, 4, 128, 16, 8192, 2048
    num_blocks = seqs * width // bs
    k_cache = torch.empty((num_blocks + 1) * bs, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    rope = RotaryEmbedding(dim, width, 1e6)
    rope.build("cuda")
    x = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
    w_qkv = (torch.randn((heads + 2 * kv_heads) * dim, hidden, device="cuda") / hidden**0.5).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(dim, device="cuda")).bfloat16()
    tables = torch.full((seqs, width // bs), num_blocks, dtype=torch.long, device="cuda")
    lens = torch.ones(seqs, dtype=torch.long, device="cuda")
    positions = torch.zeros(seqs, dtype=torch.long, device="cuda")
    slots = torch.zeros(seqs, dtype=torch.long, device="cuda")
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]

    def step() -> torch.Tensor:
        qkv = gemv(x, w_qkv).expand(seqs, -1)  # every sequence the same projection: one GEMV as in batch-1 decode
        q, k, v = (t.view(seqs, -1, dim) for t in qkv.split(sizes, dim=-1))
        q = norm_rope.attention_prologue(q, k, v, positions, rope.cos_sin, k_cache, v_cache, slots, norm_w, norm_w)
        return paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, bs)

    graphs = {}
    for tiles in (0, 1, 2, 4):  # read when the kernels are launched, so at capture
        monkeypatch.setattr(paged_attention, "PREFETCH_TILES", tiles)
        graphs[tiles] = capture_graph(step)
    gen = torch.Generator().manual_seed(1)
    for r, round_lens in enumerate(([1, 129, 4096, 8192], [4096] * 4, [700, 8191, 64, 3000])):
        round_lens = round_lens[-seqs:]
        fill_tables(tables, round_lens, bs, num_blocks, gen)
        lens.copy_(torch.tensor(round_lens))
        positions.copy_(lens - 1)
        slots.copy_(tables[torch.arange(seqs, device="cuda"), positions // bs] * bs + positions % bs)
        outs, caches = {}, {}
        for key, (graph, out) in graphs.items():
            for i, t in enumerate((x, k_cache, v_cache)):  # the same values for every variant
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(10 * r + i)))
            graph.replay()
            outs[key], caches[key] = out.clone(), (k_cache.clone(), v_cache.clone())
        for key in outs:
            assert torch.equal(outs[key], outs[0]), f"lens {round_lens}, tiles {key}"
            assert all(torch.equal(a, b) for a, b in zip(caches[key], caches[0])), f"caches, {key}"
        q, k, v = (t.view(1, -1, dim) for t in gemv(x, w_qkv).split(sizes, dim=-1))
        q, k = norm_rope.rms_norm(q, norm_w, 1e-6), norm_rope.rms_norm(k, norm_w, 1e-6)
        for i in range(seqs):  # the reference: torch's rotary, the newest row written by hand
            qi, ki = rope(positions[i : i + 1], q, k)
            k_ref, v_ref = caches[0]
            assert torch.equal(k_ref[slots[i]], ki[0]) and torch.equal(v_ref[slots[i]], v[0])
            expected = plain_attention(qi, k_ref, v_ref, tables[i : i + 1], lens[i : i + 1], bs)
            torch.testing.assert_close(outs[0][i : i + 1].double(), expected, atol=2e-2, rtol=2e-2)
