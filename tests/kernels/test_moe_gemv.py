"""The fused decode experts (`edgemoe.kernels.moe_gemv`) against `gathered_experts` and a per-token loop, on fresh
random inputs; without CUDA under Triton's interpreter (set by tests/conftest.py), hence small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from edgemoe.kernels.miss_copy import await_cpu_rows, copy_rows_pair  # noqa: E402
from edgemoe.kernels.moe_gemv import Blocks, fused_experts, pick_blocks  # noqa: E402
from edgemoe.kernels.protocol import Arrivals, CpuWait, PairBiases  # noqa: E402
from edgemoe.layers.mlp import GLUS  # noqa: E402
from edgemoe.moe.experts import gathered_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loop_reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """One (token, expert) at a time in float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


def inputs(tokens: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int, pool: int = 11):
    """A pool bigger than the rows used; ids repeat across tokens (and token 0's first id is reused by the last)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(pool, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(pool, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(pool - 2, generator=g)[:top_k] for _ in range(tokens)])  # never the last rows
    ids[-1, -1] = ids[0, 0]
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    cast = [t.to(DEVICE, dtype) for t in (x, weights, w13, w2)]
    return cast[0], ids.to(DEVICE), cast[1], cast[2], cast[3]


# H and I not multiples of any block; small blocks force several steps, a ragged last step and partial row blocks
SMALL = Blocks(up_n=4, up_k=16, up_warps=4, down_n=8, down_k=16, down_warps=4)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("blocks", [SMALL, None], ids=["small-blocks", "heuristic"])
def test_float32_matches_gathered_and_loop(tokens: int, top_k: int, blocks: Blocks | None) -> None:
    x, ids, weights, w13, w2 = inputs(tokens, top_k, hidden=37, inter=21, dtype=torch.float32, seed=tokens * 10 + top_k)
    out = fused_experts(x, ids, weights, w13, w2, blocks)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, gathered_experts(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), loop_reference(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights_dtype", [torch.float32, None])
def test_half_precision_close_to_float64(dtype: torch.dtype, weights_dtype: torch.dtype | None) -> None:
    x, ids, weights, w13, w2 = inputs(3, 4, hidden=70, inter=27, dtype=dtype, seed=7)
    weights = weights.to(weights_dtype or dtype)
    out = fused_experts(x, ids, weights, w13, w2, SMALL)
    assert out.dtype == dtype
    ref = loop_reference(x, ids, weights, w13, w2)
    err = (out.double() - ref).norm() / ref.norm()
    gathered = gathered_experts(x, ids, weights, w13, w2).double()
    assert err < 1e-2 and err <= 2 * (gathered - ref).norm() / ref.norm() + 1e-3  # no worse than the reference


def test_pool_views_and_partial_pairs_block() -> None:
    """Banks as views of a bigger pool (offset, non-contiguous expert stride), strided x and ids, top_k 3 (padded
    pairs block)."""
    x, ids, weights, w13, w2 = inputs(2, 3, hidden=24, inter=10, dtype=torch.float32, seed=3, pool=9)
    big13 = torch.randn(10, 2 * 10, 24 + 8, device=DEVICE)
    big13[1:, :, :24] = w13
    v13 = big13[1:, :, :24]  # expert stride 640, row stride 32
    x_view = torch.randn(2, 40, device=DEVICE)[:, 3:27].copy_(x)  # row stride 40
    ids_view = ids.T.contiguous().T  # column-major
    out = fused_experts(x_view, ids_view, weights, v13, w2, Blocks(8, 8, 4, 4, 8, 4))
    torch.testing.assert_close(out, gathered_experts(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


def test_writes_every_element_and_no_tokens() -> None:
    x, ids, weights, w13, w2 = inputs(3, 2, hidden=19, inter=9, dtype=torch.float32, seed=5)
    out = fused_experts(x, ids, weights, w13, w2, Blocks(2, 8, 4, 2, 4, 4))
    assert torch.isfinite(out).all() and (out != 0).all()
    assert fused_experts(x[:0], ids[:0], weights[:0], w13, w2).shape == (0, 19)


def test_block_heuristic() -> None:
    """Powers of two, bounded register tiles, never wider than the rows."""
    for hidden, inter in [(2048, 768), (2048, 1408), (4096, 14336), (256, 48), (37, 21)]:
        b = pick_blocks(hidden, inter)
        for v in (b.up_n, b.up_k, b.down_n, b.down_k):
            assert v & (v - 1) == 0
        assert b.up_k < 2 * hidden and b.down_k < 2 * inter and b.up_n < 2 * inter
        assert b.up_n * b.up_k <= 4096 and 8 * b.down_n * b.down_k <= 8192


@pytest.mark.parametrize("misses", [0, 2, 4])
def test_streamed_behind_the_miss_copy_is_bitwise_the_plain_kernel(misses: int) -> None:
    """Offloaded decode: the experts' slots partly filled by the miss copy just before, the GEMV given the copy's
    arrival counters (it waits per pair for listed slots) gives bitwise what the plain GEMV gives once the copy is
    done. The list's padding (scratch slot, as `ensure` writes it) and slots used by two pairs are included."""
    x, ids, weights, w13, w2 = inputs(3, 2, hidden=24, inter=10, dtype=torch.float32, seed=40 + misses, pool=9)
    g = torch.Generator().manual_seed(misses)
    banks = (
        torch.randn(6, *w13.shape[1:], generator=g).to(DEVICE),
        torch.randn(6, *w2.shape[1:], generator=g).to(DEVICE),
    )
    used = torch.unique(ids.flatten())
    M = used.numel()
    assert misses <= M  # these seeds route to enough distinct slots (a list longer than M would read past it)
    dst = torch.full((M,), w13.shape[0] - 1, device=DEVICE)  # the scratch slot past `count`
    dst[:misses] = used[torch.randperm(M, generator=g)[:misses]]
    src = torch.randint(0, 6, (M,), generator=g).to(DEVICE)
    count = torch.tensor(misses, device=DEVICE)
    arrived = torch.zeros(M, dtype=torch.long, device=DEVICE)
    pools = (w13.clone(), w2.clone())
    copy_rows_pair(pools, banks, src, dst, count, arrived, block=16)
    want = fused_experts(x, ids, weights, *pools, SMALL)
    arrivals = Arrivals(dst, count, arrived, int(arrived[0]) if misses else 1)
    got = fused_experts(x, ids, weights, *pools, SMALL, arrivals=arrivals)
    assert torch.equal(got, want)
    if misses:  # the copied rows were read, not the old ones
        stale = fused_experts(x, ids, weights, w13, w2, SMALL)
        assert not torch.equal(got, stale)


@pytest.mark.parametrize("blocks", [SMALL, None], ids=["small-blocks", "heuristic"])
def test_cpu_pairs(blocks: Blocks | None) -> None:
    """Pairs of id -1 take their outputs from `cpu_out` (fp32) and are weighted and summed over k in order: against
    the layout's plain-torch `decode_cpu`, and bitwise the plain kernel where no pair is on the CPU."""
    from edgemoe.offload.layout import ExpertLayout

    x, ids, weights, w13, w2 = inputs(3, 4, hidden=37, inter=21, dtype=torch.float32, seed=5)
    cpu_out = torch.randn(12, 37, device=DEVICE)
    plain = fused_experts(x, ids, weights, w13, w2, blocks)
    assert torch.equal(fused_experts(x, ids, weights, w13, w2, blocks, cpu_out=cpu_out), plain)
    on_cpu = ids.clone()
    on_cpu[0, 1] = on_cpu[2, 0] = on_cpu[2, 3] = -1
    out = fused_experts(x, on_cpu, weights, w13, w2, blocks, cpu_out=cpu_out)
    ref = ExpertLayout(37, 21, torch.float32)._decode_cpu_reference(x, on_cpu, weights, w13, w2, cpu_out)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], plain[1]), "a token without CPU pairs is computed as before"
    # a captured step's wait for the copy service's flag (here already set: the interpreter runs one program at a
    # time) changes nothing of the result
    seq = torch.tensor(7, device=DEVICE)
    wait = CpuWait(cpu_out, seq.clone(), seq, torch.tensor(3, device=DEVICE))
    assert torch.equal(fused_experts(x, on_cpu, weights, w13, w2, blocks, cpu_out=cpu_out, cpu_wait=wait), out)
    await_cpu_rows(wait)


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("biased", [True, False], ids=["biases", "no-biases"])
def test_expert_biases_and_gpt_oss_activation(act: str, biased: bool) -> None:
    """gpt-oss's experts: a bias per expert on gate/up and on down, read by each pair's expert id (here not the
    bank row: the rows are a pool's slots), and the clamped SwiGLU; inputs scaled so that some gate and up values
    pass the clamp at 7."""
    x, slots, weights, w13, w2 = inputs(3, 4, hidden=37, inter=21, dtype=torch.float32, seed=31)
    g = torch.Generator().manual_seed(32)
    x = x * 6
    experts = torch.randint(0, 9, slots.shape, generator=g).to(DEVICE)  # the pairs' experts: their biases' rows
    bias = None
    if biased:
        b13, b2 = torch.randn(9, 2 * 21, generator=g) * 3, torch.randn(9, 37, generator=g)
        bias = PairBiases(b13.to(DEVICE), b2.to(DEVICE), experts.flatten())
    out = fused_experts(x, slots, weights, w13, w2, SMALL, bias=bias, act=act)
    ref = gathered_experts(x, slots, weights, w13, w2, GLUS[act], bias)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    if act == "swiglu_oai":  # the clamp mattered
        gate = torch.einsum("th,tkih->tki", x, w13[slots][:, :, :21])
        assert (gate > 7).any() and (gate < 7).any()
    if biased:  # the biases mattered, by expert id
        plain = fused_experts(x, slots, weights, w13, w2, SMALL, act=act)
        assert (out - plain).abs().max() > 0.1
