"""The quantized decode experts (`edgemoe.kernels.quant_gemv`) against gguf's own numpy dequantization with a
float64 matmul (independent of edgemoe) and against `quant_experts_reference`, on fresh random blocks of every
format; without CUDA under Triton's interpreter (set by tests/conftest.py), hence small shapes and large tiles.

Tolerances. float32 x: kernel and reference dequantize to the same float32 weights (up to the kernel's one FMA per
weight, ~1e-7 relative) and accumulate in float32 in different orders; over H = 256 products each sum carries
~sqrt(H) 2^-24 ~ 1e-6 relative rounding, so 1e-5 (relative to the output's scale) leaves a 10x margin. bfloat16 x:
both round h and the output to bfloat16 (2^-8 = 0.4 % per element); an element of h whose float32 value sits on a
rounding boundary may round the other way in one of them, so elementwise 2 bf16 ulps (rtol 1.6e-2) against the
reference and 1 % in norm against float64 (the output's own rounding is 0.2 % RMS). Triton's interpreter rounds
float32 to bfloat16 by truncation (the GPU to nearest), which triples the kernel's error here (0.6 % against the
reference's 0.2 %): still inside both bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from edgemoe.kernels.miss_copy import copy_rows_pair  # noqa: E402
from edgemoe.kernels.protocol import Arrivals, PairBiases  # noqa: E402
from edgemoe.kernels.quant_gemv import (  # noqa: E402
    QuantBlocks,
    pick_blocks,
    quant_experts_reference,
    quant_fused_experts,
)
from edgemoe.layers.mlp import GLUS  # noqa: E402
from edgemoe.moe.experts import gathered_experts  # noqa: E402
from edgemoe.quant import QUANT_TYPES, quant_type, random_blocks, row_bytes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, TOP_K = 4, 2


def shapes(q13: str, q2: str) -> tuple[int, int]:
    """(H, I): one or two super-blocks for the K formats; for the 32-weight ones I = 96, 3 blocks (a ragged step)."""
    if 256 in (quant_type(q13).block_weights, quant_type(q2).block_weights):
        return 256, 256
    return 128, 96


def banks(q13: str, q2: str, hidden: int, inter: int, seed: int, experts: int = EXPERTS):
    """Random blocks in one joined row per expert (gate_up then down), the banks strided views into it, as the
    expert pools hold them -> (joined, w13 [E, 2I, rb13], w2 [E, H, rb2])."""
    g = torch.Generator().manual_seed(seed)
    w13 = random_blocks((experts, 2 * inter, hidden), q13, g, std=hidden**-0.5)
    w2 = random_blocks((experts, hidden, inter), q2, g, std=inter**-0.5)
    joined = torch.cat([w13.flatten(1), w2.flatten(1)], dim=1).to(DEVICE)
    a = w13[0].numel()
    return joined, joined[:, :a].view(w13.shape), joined[:, a:].view(w2.shape)


def routing(tokens: int, hidden: int, dtype: torch.dtype, seed: int, experts: int = EXPERTS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)]).to(DEVICE)
    ids[-1, -1] = ids[0, 0]  # an expert shared across tokens (a no-op at one token)
    weights = (torch.rand(tokens, TOP_K, generator=g) + 0.1).to(DEVICE)
    return x, ids, weights


def gguf_reference(x, ids, weights, w13, w2, q13: str, q2: str) -> torch.Tensor:
    """gguf's numpy dequantization, then float64 pair by pair (h unrounded)."""
    deq = {}
    for name, bank, q in (("w13", w13, q13), ("w2", w2, q2)):
        deq[name] = gguf.quants.dequantize(bank.cpu().numpy(), gguf.GGMLQuantizationType[q]).astype(np.float64)
    xs, out = x.double().cpu().numpy(), np.zeros(tuple(x.shape))
    for t, k in np.ndindex(*ids.shape):
        e = int(ids[t, k])
        gate, up = np.split(deq["w13"][e] @ xs[t], 2)
        out[t] += float(weights[t, k]) * (deq["w2"][e] @ (gate / (1 + np.exp(-gate)) * up))
    return torch.from_numpy(out)


def tiles(q13: str, q2: str, hidden: int, inter: int, blocks_per_step: int | None = None) -> QuantBlocks:
    """Large tiles (few programs: the interpreter's cost is per program); up_n 64 > I = 96 / 2: a ragged row
    block. `blocks_per_step` past a row's blocks: steps that overhang the row."""
    b = pick_blocks(quant_type(q13), quant_type(q2), hidden, inter)
    up_blocks, down_blocks = (blocks_per_step, blocks_per_step) if blocks_per_step else (b.up_blocks, b.down_blocks)
    return QuantBlocks(64, up_blocks, 4, 64, down_blocks, 4)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


PAIRS = [(name, name) for name in QUANT_TYPES] + [("Q4_K", "Q6_K")]  # Q4_K_M: Q4_K gate_up, Q6_K down


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("q13, q2", PAIRS, ids=[a if a == b else f"{a}+{b}" for a, b in PAIRS])
def test_float32_matches_gguf_and_reference(q13: str, q2: str, tokens: int) -> None:
    hidden, inter = shapes(q13, q2)
    _, w13, w2 = banks(q13, q2, hidden, inter, seed=PAIRS.index((q13, q2)))
    x, ids, weights = routing(tokens, hidden, torch.float32, seed=tokens)
    out = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, tiles(q13, q2, hidden, inter))
    assert out.dtype == torch.float32 and out.shape == (tokens, hidden) and torch.isfinite(out).all()
    ref = quant_experts_reference(x, ids, weights, w13, w2, q13, q2, inter, hidden)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    assert rel(out, gguf_reference(x, ids, weights, w13, w2, q13, q2)) < 1e-5


@pytest.mark.parametrize("q13, q2", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("MXFP4", "MXFP4")])
def test_bfloat16_close_to_reference_and_gguf(q13: str, q2: str) -> None:
    hidden, inter = shapes(q13, q2)
    _, w13, w2 = banks(q13, q2, hidden, inter, seed=11)
    x, ids, weights = routing(3, hidden, torch.bfloat16, seed=12)
    out = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, tiles(q13, q2, hidden, inter))
    assert out.dtype == torch.bfloat16
    ref = quant_experts_reference(x, ids, weights, w13, w2, q13, q2, inter, hidden)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2 * ref.abs().max().item())
    assert rel(out, gguf_reference(x, ids, weights, w13, w2, q13, q2)) < 1e-2


@pytest.mark.parametrize("q13, q2", [("Q4_K", "Q5_K"), ("Q4_0", "Q8_0")])
def test_steps_past_the_row(q13: str, q2: str) -> None:
    """Two K super-blocks per step over rows of one (H = I = 256), four 32-blocks per step over rows of three:
    clamped blocks meet x = 0; down with 8 rows per program. Also the default blocks, at one token."""
    hidden, inter = shapes(q13, q2)
    _, w13, w2 = banks(q13, q2, hidden, inter, seed=21)
    x, ids, weights = routing(2, hidden, torch.float32, seed=22)
    ref = quant_experts_reference(x, ids, weights, w13, w2, q13, q2, inter, hidden)
    per_step = 2 if q13 == "Q4_K" else 4
    for b in (tiles(q13, q2, hidden, inter, per_step), QuantBlocks(16, per_step, 4, 8, per_step, 4)):
        out = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, b)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    out = quant_fused_experts(x[:1], ids[:1], weights[:1], w13, w2, q13, q2, inter, hidden)  # pick_blocks'
    torch.testing.assert_close(out, ref[:1], rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_no_tokens_and_bad_banks() -> None:
    _, w13, w2 = banks("Q8_0", "Q8_0", 128, 96, seed=0)
    x, ids, weights = routing(1, 128, torch.float32, seed=0)
    assert quant_fused_experts(x[:0], ids[:0], weights[:0], w13, w2, "Q8_0", "Q8_0", 96, 128).shape == (0, 128)
    with pytest.raises(AssertionError):  # rows of the wrong format
        quant_fused_experts(x, ids, weights, w13, w2, "Q4_0", "Q8_0", 96, 128)
    with pytest.raises(AssertionError):  # a Q8_0 bank at an odd byte: its halves would be misaligned
        odd = torch.zeros(w2.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(w2.shape)
        quant_fused_experts(x, ids, weights, w13, odd, "Q8_0", "Q8_0", 96, 128)


def test_block_heuristic() -> None:
    """Powers of two, a step of 256 weights (Q8_0's up: 1,024) at most the row's blocks, up's fields from gate_up's
    format only."""
    for hidden, inter in [(2048, 768), (4096, 14336), (2880, 2880), (256, 96)]:
        for q13 in QUANT_TYPES.values():
            for q2 in QUANT_TYPES.values():
                if hidden % q13.block_weights or inter % q2.block_weights:
                    continue
                b = pick_blocks(q13, q2, hidden, inter)
                for v in (b.up_n, b.up_blocks, b.down_n, b.down_blocks):
                    assert v & (v - 1) == 0
                up_step = 1024 if q13.name == "Q8_0" else 256
                assert b.up_blocks * q13.block_weights <= up_step and b.down_blocks * q2.block_weights <= 256
                assert b.up_blocks < 2 * hidden / q13.block_weights and b.down_blocks < 2 * inter / q2.block_weights
                assert b.up_n == pick_blocks(q13, q13, hidden, inter).up_n


@pytest.mark.parametrize("misses", [0, 2])
def test_streamed_behind_the_miss_copy_is_bitwise_the_plain_kernel(misses: int) -> None:
    """Offloaded decode with quantized rows: slots partly filled by the miss copy just before (one joined uint8 row
    per expert, both banks copied as views of it), the GEMV given the copy's arrival counters gives bitwise what the
    plain GEMV gives once the copy is done (as moe_gemv's test of the same, whose `_await_rows` it reuses)."""
    q13, q2, hidden, inter = "Q4_K", "Q6_K", 256, 256
    pool, w13, w2 = banks(q13, q2, hidden, inter, seed=30 + misses, experts=6)  # [S + 1, ...]: slot 5 scratch
    host, b13, b2 = banks(q13, q2, hidden, inter, seed=40 + misses, experts=5)
    x, ids, weights = routing(3, hidden, torch.float32, seed=misses, experts=5)
    g = torch.Generator().manual_seed(misses)
    used = torch.unique(ids.flatten())
    M = used.numel()
    dst = torch.full((M,), 5, device=DEVICE)  # the scratch slot past `count`
    dst[:misses] = used[torch.randperm(M, generator=g)[:misses]]
    src = torch.randint(0, 5, (M,), generator=g).to(DEVICE)
    count = torch.tensor(misses, device=DEVICE)
    arrived = torch.zeros(M, dtype=torch.long, device=DEVICE)
    stale = pool.clone()
    copy_rows_pair((w13, w2), (b13, b2), src, dst, count, arrived, block=4096)
    blocks = tiles(q13, q2, hidden, inter)
    want = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, blocks)
    arrivals = Arrivals(dst, count, arrived, int(arrived[0]) if misses else 1)
    got = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, blocks, arrivals=arrivals)
    assert torch.equal(got, want)
    if misses:  # the copied rows were read, not the old ones
        a = row_bytes(q13, hidden) * 2 * inter
        old = quant_fused_experts(
            x, ids, weights, stale[:, :a].view(w13.shape), stale[:, a:].view(w2.shape), q13, q2, inter, hidden, blocks
        )
        assert not torch.equal(got, old)


@pytest.mark.parametrize("q13, q2", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")])
def test_cpu_pairs(q13: str, q2: str) -> None:
    """Pairs of id -1 take their outputs from `cpu_out` (fp32) and are weighted and summed over k in order: against
    the layout's plain-torch `decode_cpu` over the reference decode (float32), bitwise the plain kernel where no pair
    is on the CPU and for a token without CPU pairs, and unchanged by a captured step's wait for the flag."""
    from edgemoe.kernels.miss_copy import await_cpu_rows
    from edgemoe.kernels.protocol import CpuWait
    from edgemoe.offload.layout import QuantExpertLayout

    hidden, inter = shapes(q13, q2)
    _, w13, w2 = banks(q13, q2, hidden, inter, seed=31)
    x, ids, weights = routing(3, hidden, torch.float32, seed=32)
    b = tiles(q13, q2, hidden, inter)
    cpu_out = torch.randn(3 * TOP_K, hidden, generator=torch.Generator().manual_seed(33)).to(DEVICE)
    plain = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, b)
    assert torch.equal(quant_fused_experts(x, ids, weights, w13, w2, q13, q2, inter, hidden, b, cpu_out=cpu_out), plain)
    on_cpu = ids.clone()
    on_cpu[0, 1] = on_cpu[2, 0] = on_cpu[2, 1] = -1  # token 2: both pairs on the CPU
    out = quant_fused_experts(x, on_cpu, weights, w13, w2, q13, q2, inter, hidden, b, cpu_out=cpu_out)
    layout = QuantExpertLayout(hidden, inter, q13, q2, torch.float32)
    ref = layout._decode_cpu_reference(x, on_cpu, weights, w13, w2, cpu_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(out[1], plain[1]), "a token without CPU pairs is computed as before"
    assert not torch.equal(out[0], plain[0])
    seq = torch.tensor(7, device=DEVICE)
    wait = CpuWait(cpu_out, seq.clone(), seq, torch.tensor(3, device=DEVICE))
    kernel = quant_fused_experts(x, on_cpu, weights, w13, w2, q13, q2, inter, hidden, b, cpu_out=cpu_out, cpu_wait=wait)
    assert torch.equal(kernel, out)
    await_cpu_rows(wait)


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_dense_linear_matches_gguf_and_is_batch_invariant(name: str) -> None:
    """`quant_linear` (decode's dense projections on GGUF blocks): against gguf's dequantization with a float64
    matmul, a bias, rows not a whole tile, a token's row bitwise the same alone and among five, written into a
    column slice of a wider output."""
    from edgemoe.kernels.quant_gemv import quant_linear

    K = 256 if quant_type(name).block_weights == 256 else 96
    g = torch.Generator().manual_seed(31)
    w = random_blocks((40, K), name, g, std=K**-0.5)
    x, bias = torch.randn(5, K, generator=g), torch.randn(40, generator=g)
    dense = gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[name]).astype(np.float64)
    ref = torch.from_numpy(x.double().numpy() @ dense.T + bias.double().numpy())
    wide = torch.full((5, 60), float("nan"), device=DEVICE)
    y = quant_linear(x.to(DEVICE), w.to(DEVICE), name, bias=bias.to(DEVICE), out=wide[:, 10:50])
    assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5
    assert torch.isnan(wide[:, :10]).all() and torch.isnan(wide[:, 50:]).all()
    alone = quant_linear(x[:1].to(DEVICE), w.to(DEVICE), name, bias=bias.to(DEVICE))
    assert torch.equal(alone, y[:1])


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_mxfp4_experts_with_biases_and_gpt_oss_activation(act: str) -> None:
    """gpt-oss's experts as stored (MXFP4): each pair's biases read by its expert id while its rows are another
    bank row (a slot), the clamped SwiGLU with inputs scaled past the clamp; against gguf's dequantization, then the
    plain-torch expert math with the same biases and activation."""
    hidden, inter = shapes("MXFP4", "MXFP4")
    _, w13, w2 = banks("MXFP4", "MXFP4", hidden, inter, seed=51)
    x, slots, weights = routing(3, hidden, torch.float32, seed=52)
    x = x * 8
    g = torch.Generator().manual_seed(53)
    experts = torch.randint(0, 7, slots.shape, generator=g).to(DEVICE)
    b13, b2 = (torch.randn(7, 2 * inter, generator=g) * 3).to(DEVICE), torch.randn(7, hidden, generator=g).to(DEVICE)
    bias = PairBiases(b13, b2, experts.flatten())
    b = tiles("MXFP4", "MXFP4", hidden, inter)
    out = quant_fused_experts(x, slots, weights, w13, w2, "MXFP4", "MXFP4", inter, hidden, b, bias=bias, act=act)
    d13, d2 = (
        torch.from_numpy(gguf.quants.dequantize(w.cpu().numpy(), gguf.GGMLQuantizationType.MXFP4)).float().to(DEVICE)
        for w in (w13, w2)
    )
    ref = gathered_experts(x, slots, weights, d13, d2, GLUS[act], bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    plain = quant_fused_experts(x, slots, weights, w13, w2, "MXFP4", "MXFP4", inter, hidden, b, act=act)
    assert (out - plain).abs().max() > 0.1  # the biases mattered
