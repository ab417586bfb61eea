"""Paged decode attention on CUDA: one query token per sequence against its KV blocks, read in place through the
block table and only up to the sequence's context length (split-KV, "flash decoding"). Its reference is
`PagedAttention._decode_torch`, which gathers the whole padded table and masks.

- partial, program (seq, kv head, split): one split of the sequence's context, for all the `group` query heads that
  share the KV head (K/V read once per KV head), in tiles of `block_n` tokens with an online softmax in fp32. The
  number of splits S is fixed by the model's shape and the GPU (`choose_splits`), never by the batch; their length
  follows the context length read on the device: L = cdiv(ctx_len, S) rounded up to whole tiles (at least
  `min_split_tiles`), split s covering [s * L, min((s + 1) * L, ctx_len)), so a short context in a table padded
  far past it still spreads over many programs (4K tokens at S = 128: 32 two-tile splits per KV head, where fixed
  512-token splits made 8). Splits past the context exit at once, before the PDL wait (docs/findings.md, "Reduce in
  one round trip, empty splits exit early").
- reduce, program (seq, head): combines the cdiv(ctx_len, L) splits that hold tokens (max / sum-exp rescaling) into
  the output: with at most 64 splits in one round trip to memory (every split's max, sum and accumulator loaded at
  once), with more in chunks of 64 after a pass over the maxima. With S = 1 (forced: tests and benchmarks) the
  partial kernel normalises and writes the output itself, and reduce does not run.
- a sliding `window` (a constexpr: gpt-oss's and Gemma-4's sliding layers) starts the splits at the tile holding the
  window's first token: they share the window's tokens, the blocks before it are never read, the first tile masks
  its tokens before the window. Attention `sinks` (gpt-oss: a logit per head, no value) join the softmax's
  denominator once, where the output is normalised (reduce, or the one split). Both are constexpr branches: the
  kernel of a layer without them compiles to the PTX it had before they existed.

Both kernels are latency-bound at decode's short splits, so each reads the context length, a step input written
before the step's first kernel, before waiting on the previous kernel (`wait_for_inputs`): that round trip overlaps
the previous kernel instead of following it. The grid follows from the shapes, never from the context lengths, and
nothing syncs with the host: CUDA-graph capturable once compiled (the partials workspace comes from torch's
allocator, so from the graph pool), and a replay with new context lengths re-splits them.
`benchmarks/paged_attention.py` times it against the reference.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from edgemoe.kernels.pdl import launch_args, prefetch_rows_l2, wait_for_inputs

PROGRAMS_PER_SM = 4  # the partial kernel's target: several resident programs per SM hide its load latency
MAX_SPLITS = 256  # bounds the partials workspace and the reduce's serial work
STAND_IN_SMS = 132  # an H200's count, for CPU tensors (the interpreter): deterministic tests
BLOCK_N = 64  # tokens per tile
# the partial kernel's warps and pipeline stages (its plain `range` loop keeps STAGES - 1 tiles' loads ahead; 3 is
# Triton's default)
WARPS, STAGES = 4, 3
# tiles of K and V a partial program asks into L2 before its PDL wait (sm_90+), overlapping the qkv GEMV since the
# prologue lets attention be scheduled early (docs/findings.md, "The prologue's early trigger and one K/V tile")
PREFETCH_TILES = 1
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_LOG2E = tl.constexpr(math.log2(math.e))  # a sink logit into the kernels' log2 domain


def choose_splits(kv_heads: int, sms: int) -> int:
    """Splits per (sequence, KV head): the smallest power of two S with kv_heads * S >= the largest power of two <=
    PROGRAMS_PER_SM * sms programs (512 on an H200's 132 SMs; docs/findings.md, "Splits: 512 programs, at least two
    tiles"), capped at MAX_SPLITS.

    Decode reads the KV once with little arithmetic, so its speed is the HBM bandwidth the grid draws; one program
    streams its split from one SM, and one SM alone draws a small share of it, so the programs holding tokens must
    cover every SM, several each, already at batch 1. The splits share the context, not the padded width, so the
    target holds at any context of at least S tiles (below that fewer splits hold tokens). Only the model's shape and
    the GPU enter: a sequence's context is cut the same way whatever its batch and its block table's width, so its
    output does not depend on them (batch invariance; graphs, which pad both, equal eager steps), and a CUDA graph
    captures a fixed S. A batch pays for it in programs that exit at once (splits past a context: before the PDL
    wait) and in partials of splits it could have merged."""
    target = 1 << ((PROGRAMS_PER_SM * sms).bit_length() - 1)
    splits = 1
    while splits * 2 <= MAX_SPLITS and kv_heads * splits < target:
        splits *= 2
    return splits


def min_split_tiles(kv_heads: int, splits: int, sms: int) -> int:
    """Tiles a split holds at least: 2 where half the splits still give every SM a program, else 1. A short context
    then spreads over fewer, two-tile, splits, while one KV head keeps one-tile splits (docs/findings.md, "Splits:
    512 programs, at least two tiles"). Like S, fixed by the shapes alone (batch invariance)."""
    return 2 if kv_heads * splits >= 2 * sms else 1


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return STAND_IN_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _split_len(ctx_len, num_splits, min_tiles, BLOCK_N: tl.constexpr):
    # tokens per split for this context: cdiv(ctx_len, num_splits) in whole tiles, at least min_tiles (>= 1, for
    # ctx_len 0 too)
    tiles = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N)
    return tl.maximum(tiles, min_tiles) * BLOCK_N


@triton.jit
def _window_tile(ctx_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    # the first token of the tile holding the window's first key (0 without a window): the splits share the tokens
    # from there, and the tiles before it are never read
    first = 0
    if WINDOW > 0:
        first = tl.maximum(ctx_len - WINDOW, 0) // BLOCK_N * BLOCK_N
    return first


@triton.jit
def _partial(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    out,
    m_part,
    l_part,
    acc_part,
    sinks,
    qk_scale,
    width,
    num_splits,
    min_tiles,
    heads,
    stride_qs,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_os,
    stride_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    DOT_TY: tl.constexpr,
    PRECISION: tl.constexpr,
    PREFETCH_N: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    PDL: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the context length is a step input, written before the step's first kernel: read before the wait, so that
    # its round trip overlaps the previous kernel (the prologue that writes q and this token's K and V)
    ctx_len = tl.minimum(tl.load(context_lens + seq).to(tl.int32), width)  # the reference masks to the width too
    first = _window_tile(ctx_len, WINDOW, BLOCK_N)
    span = _split_len(ctx_len - first, num_splits, min_tiles, BLOCK_N)
    start = first + split * span  # a multiple of BLOCK_N: tiles stay aligned
    end = tl.minimum(start + span, ctx_len)  # past the context: no iterations
    if not SINGLE and start >= ctx_len:
        return  # a split past the context reads and writes nothing: it need not wait (its exit lets the reduce launch)
    seq64 = seq.to(tl.int64)
    table = block_tables + seq64 * stride_bt
    k_base = k_cache + kvh * stride_kh
    v_base = v_cache + kvh * stride_vh
    if PREFETCH_N > 0:  # the split's first tokens of K and V into L2 before the wait (step inputs and earlier steps'
        # cache rows; the newest token is the prologue's to write, so it is left out)
        tp = start + tl.arange(0, PREFETCH_N)
        ahead = tp < tl.minimum(end, ctx_len - 1)
        if WINDOW > 0:
            ahead = ahead & (tp >= ctx_len - WINDOW)
        slot_p = tl.load(table + tp // BS, mask=ahead, other=0).to(tl.int64) * BS + tp % BS
        prefetch_rows_l2(k_base + slot_p * stride_ks, tl.where(ahead, ROW_BYTES, 0))
        prefetch_rows_l2(v_base + slot_p * stride_vs, tl.where(ahead, ROW_BYTES, 0))
    wait_for_inputs(PDL)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    rows = g < GROUP  # real query heads (the tile is padded to tl.dot's minimum of 16 rows)
    head = kvh * GROUP + g  # [G_PAD] query heads sharing this KV head (enable_gqa's repeat_interleave order)
    q_ptr = q + seq64 * stride_qs + head[:, None] * stride_qh + d[None, :]
    q_tile = tl.load(q_ptr, mask=rows[:, None], other=0.0).to(DOT_TY)  # [G_PAD, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + n  # [BLOCK_N] token positions
        valid = t < end  # at least one token (t0, or the window's first), so every row of s has a finite max
        if WINDOW > 0:
            valid = valid & (t >= ctx_len - WINDOW)  # the first tile's tokens before the window
        block = tl.load(table + t // BS, mask=valid, other=0).to(tl.int64)
        slot = block * BS + t % BS  # int64: slot * stride overflows int32 for large caches
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        if G_PAD == 1:  # MHA: products and sums, no 16-row padding
            s = tl.sum(k.to(tl.float32) * q_tile.to(tl.float32), axis=1)[None, :]  # [1, BLOCK_N]
        else:
            s = tl.dot(q_tile, tl.trans(k.to(DOT_TY)), input_precision=PRECISION)  # [G_PAD, BLOCK_N] fp32
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # guard: -inf - -inf would give NaN below
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # 0 at masked tokens
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=valid[:, None], other=0.0)
        if G_PAD == 1:
            pv = tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]  # [1, D]
        else:
            pv = tl.dot(p.to(DOT_TY), v.to(DOT_TY), input_precision=PRECISION)  # [G_PAD, D] fp32
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SINGLE:
        if SINKS:  # the sink joins the denominator once, with no value: here, or in reduce
            sink = tl.load(sinks + head, mask=rows, other=0.0).to(tl.float32) * _LOG2E
            m_top = tl.maximum(m_i, sink)
            m_top = tl.where(m_top == float("-inf"), 0.0, m_top)  # no token and a sink at -inf: NaN-free
            alpha = tl.exp2(m_i - m_top)
            l_i = l_i * alpha + tl.exp2(sink - m_top)
            acc = acc * alpha[:, None]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context: zeros
        o_ptr = out + seq64 * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, o.to(out.dtype.element_ty), mask=rows[:, None])
    elif start < ctx_len:  # splits past the context write nothing; reduce never reads them
        row = (seq64 * heads + head) * num_splits + split  # [G_PAD] rows of the partials
        tl.store(m_part + row, m_i, mask=rows)
        tl.store(l_part + row, l_i, mask=rows)
        tl.store(acc_part + row[:, None] * D + d[None, :], acc, mask=rows[:, None])


@triton.jit
def _reduce(
    m_part,
    l_part,
    acc_part,
    sinks,
    context_lens,
    out,
    width,
    num_splits,
    min_tiles,
    heads,
    stride_os,
    stride_oh,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq, h = tl.program_id(0), tl.program_id(1)
    ctx_len = tl.minimum(tl.load(context_lens + seq).to(tl.int32), width)  # a step input: read before the wait
    keys = ctx_len - _window_tile(ctx_len, WINDOW, BLOCK_N)  # the tokens the splits share
    used = tl.cdiv(keys, _split_len(keys, num_splits, min_tiles, BLOCK_N))  # splits the partial kernel wrote
    if SINKS:  # a weight: read before the wait too
        sink = tl.load(sinks + h).to(tl.float32) * _LOG2E
    base = (seq.to(tl.int64) * heads + h) * num_splits
    d = tl.arange(0, D)
    wait_for_inputs(PDL)
    if SPLITS_PAD <= BLOCK_S:  # every split's max, sum and accumulator loaded at once: one round trip to memory
        i = tl.arange(0, SPLITS_PAD)
        m_i = tl.load(m_part + base + i, mask=i < used, other=float("-inf"))
        l_i = tl.load(l_part + base + i, mask=i < used, other=0.0)
        a_i = tl.load(acc_part + (base + i)[:, None] * D + d[None, :], mask=(i < used)[:, None], other=0.0)
        top = tl.max(m_i, axis=0)
        if SINKS:
            top = tl.maximum(top, sink)
        top = tl.where(top == float("-inf"), 0.0, top)  # empty context: keeps exp2 below NaN-free
        w_i = tl.exp2(m_i - top)  # 0 at the splits past the context
        l_sum = tl.sum(w_i * l_i, axis=0)
        acc = tl.sum(w_i[:, None] * a_i, axis=0)
        if SINKS:  # the sink's term, no value
            l_sum += tl.exp2(sink - top)
    else:  # more splits: the maxima first, then the accumulators in chunks that keep the [splits, D] tile small
        s = tl.arange(0, SPLITS_PAD)
        m = tl.load(m_part + base + s, mask=s < used, other=float("-inf"))
        m_max = tl.max(m, axis=0)
        if SINKS:
            m_max = tl.maximum(m_max, sink)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty context: keeps exp2 below NaN-free
        l_sum = tl.sum(tl.exp2(m - m_max) * tl.load(l_part + base + s, mask=s < used, other=0.0), axis=0)
        sb = tl.arange(0, BLOCK_S)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, used, BLOCK_S):
            i = s0 + sb
            w = tl.exp2(tl.load(m_part + base + i, mask=i < used, other=float("-inf")) - m_max)  # [BLOCK_S]
            a = tl.load(acc_part + (base + i)[:, None] * D + d[None, :], mask=(i < used)[:, None], other=0.0)
            acc += tl.sum(w[:, None] * a, axis=0)
        if SINKS:
            l_sum += tl.exp2(sink - m_max)
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out + seq.to(tl.int64) * stride_os + h * stride_oh + d, o.to(out.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int | None = None,
    stages: int | None = None,
) -> torch.Tensor:
    """q: [seqs, heads, head_dim]; k_cache, v_cache: [num_slots, kv_heads, head_dim] (slot = block * block_size +
    offset); block_tables: [seqs, max_blocks] int64 (entries past a sequence's context are never read);
    context_lens: [seqs] int64 on the device -> [seqs, heads, head_dim] in q's dtype. head_dim a power of two >= 16
    (others: ValueError, use the torch path); heads a multiple of kv_heads. `window`: the query sees only the last
    `window` tokens of its context (itself included; the blocks before them are not read), None for all; `sinks`
    [heads] float: a logit per head that joins the softmax's denominator with no value, None for none (each window
    compiles its own kernel; without either, the kernel is the one without their branches). `splits` (None:
    `choose_splits`'s), `block_n`, `num_warps` and `stages` (None: WARPS, STAGES) are for tests (the interpreter) and
    benchmarks/paged_attention.py's sweep."""
    seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"paged_decode_attention needs a power-of-two head_dim >= 16, got {dim}")
    if heads % kv_heads or k_cache.shape[2] != dim or v_cache.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"shapes do not match: q {list(q.shape)}, k {list(k_cache.shape)}, v {list(v_cache.shape)}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"KV cache dtype {k_cache.dtype} / {v_cache.dtype}: use one of float32, bfloat16, float16")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if sinks is not None and (sinks.shape != (heads,) or not sinks.is_floating_point() or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be [{heads}] float and contiguous, got {list(sinks.shape)} {sinks.dtype}")
    width = block_tables.shape[1] * block_size  # padded tokens: bounds the context lengths
    sms = _sm_count(q.device)
    if splits is None:
        splits = choose_splits(kv_heads, sms)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    min_tiles = min_split_tiles(kv_heads, splits, sms)
    q = q if q.stride(2) == 1 else q.contiguous()
    group = heads // kv_heads
    g_pad = 1 if group == 1 else max(16, triton.next_power_of_2(group))
    single = splits == 1
    out = torch.empty(seqs, heads, dim, dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    if single:
        m_part = l_part = acc_part = out  # unused
    else:
        m_part = torch.empty(seqs, heads, splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(seqs, heads, splits, dim, dtype=torch.float32, device=q.device)
    # dot operands in the cache's dtype (tensor cores for 16-bit); fp32 stays fp32 (no tf32). Triton's interpreter
    # (CPU tensors) multiplies bf16 dot operands as raw bits (triton-lang/triton#11584), so there they go to fp32.
    interpreted_bf16 = not k_cache.is_cuda and k_cache.dtype == torch.bfloat16
    dot_ty = tl.float32 if interpreted_bf16 else _DTYPES[k_cache.dtype]
    precision = "ieee" if dot_ty == tl.float32 else "tf32"  # (tf32: the default, ignored for 16-bit operands)
    row_bytes = dim * k_cache.element_size()
    launch = launch_args(q.device)
    # bulk requests: 16-byte rows; a power-of-two count of tokens
    prefetch = PREFETCH_TILES * block_n if launch["PDL"] and row_bytes % 16 == 0 else 0
    if prefetch & (prefetch - 1):
        raise ValueError(f"PREFETCH_TILES * block_n must be a power of two, got {prefetch}")
    _partial[(seqs, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, m_part, l_part, acc_part, sinks,
        scale * math.log2(math.e), width, splits, min_tiles, heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        group, g_pad, dim, block_size, block_n, single, dot_ty, precision, prefetch, row_bytes,
        WINDOW=window or 0, SINKS=sinks is not None, num_warps=num_warps or WARPS, num_stages=stages or STAGES,
        **launch,
    )  # fmt: skip
    if not single:  # chunks of up to 64 splits: few serial iterations at hundreds of splits, in ~64 registers
        splits_pad = triton.next_power_of_2(splits)
        _reduce[(seqs, heads)](
            m_part, l_part, acc_part, sinks, context_lens, out, width, splits, min_tiles, heads, out.stride(0),
            out.stride(1), dim, block_n, splits_pad, min(64, splits_pad), WINDOW=window or 0, SINKS=sinks is not None,
            num_warps=4, **launch,
        )  # fmt: skip
    return out
