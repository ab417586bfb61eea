"""The quantized matrix kernels (`edgemoe.kernels.quant_gemm`: prefill's grouped expert GEMM and the dense quantized
matmul) against gguf's own numpy dequantization with a float64 matmul (independent of edgemoe) and against the plain
torch references, on fresh random blocks of every format; without CUDA under Triton's interpreter (tests/conftest.py).

Tolerances: float32 activations keep float32 weights and an IEEE dot; kernel and reference differ by the kernel's one
FMA per weight (~1e-7 relative) and the summation order over K = 256 products (~1e-6), so 1e-5 relative in norm.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from edgemoe.kernels.quant_gemm import QuantTiles, quant_grouped_gemm, quant_matmul, quant_pair_outputs  # noqa: E402
from edgemoe.kernels.quant_gemv import quant_experts_reference  # noqa: E402
from edgemoe.layers.quant import QUANT_TYPES, quant_type, random_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAIRS = [(name, name) for name in QUANT_TYPES] + [("Q4_K", "Q6_K")]
IDS = [a if a == b else f"{a}+{b}" for a, b in PAIRS]


def width(name: str, ragged: bool = False) -> int:
    """A row: one super-block of a K format; 96 or 160 weights of a 32-weight format (3 or 5 blocks, not a whole
    number of the kernel's 4- or 2-block reduction units when `ragged`)."""
    if quant_type(name).block_weights == 256:
        return 256
    return 96 if ragged else 128


def gguf_dense(raw: torch.Tensor, name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType[name]).astype(np.float64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(QUANT_TYPES))
@pytest.mark.parametrize("tokens", [3, 21])
def test_matmul_matches_gguf(name: str, tokens: int) -> None:
    """Both orientations (16-token tiles with the weights as the MMA's tall side, 64-token tiles), a bias, rows not a
    whole tile (N = 80), a ragged K for the 32-weight formats."""
    K, N = width(name, ragged=True), 80
    g = torch.Generator().manual_seed(7 + tokens)
    w = random_blocks((N, K), name, g, std=K**-0.5)
    x, bias = torch.randn(tokens, K, generator=g), torch.randn(N, generator=g)
    ref = torch.from_numpy(x.double().numpy() @ gguf_dense(w, name).T + bias.double().numpy())
    for tiles in (QuantTiles(m=16, n=64, warps=4), QuantTiles(m=64, n=16, warps=4)):
        y = quant_matmul(x.to(DEVICE), w.to(DEVICE), name, bias=bias.to(DEVICE), tiles=tiles)
        assert y.shape == (tokens, N) and rel(y, ref) < 1e-5, (tiles, rel(y, ref))


def test_matmul_writes_into_a_slice() -> None:
    """`out` as a column slice of a wider tensor (a fused projection's part): only those columns are written."""
    K, N = 256, 48
    g = torch.Generator().manual_seed(3)
    w = random_blocks((N, K), "Q6_K", g, std=K**-0.5).to(DEVICE)
    x = torch.randn(5, K, generator=g).to(DEVICE)
    wide = torch.full((5, 3 * N), float("nan"), device=DEVICE)
    quant_matmul(x, w, "Q6_K", out=wide[:, N : 2 * N])
    assert torch.isnan(wide[:, :N]).all() and torch.isnan(wide[:, 2 * N :]).all()
    torch.testing.assert_close(wide[:, N : 2 * N], quant_matmul(x, w, "Q6_K"), rtol=0, atol=0)


def banks(q13: str, q2: str, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(w13, w2, H, I): one super-block a row where a K format is used, else H = 128 and I = 96 (ragged for the
    32-weight formats' 4-block units)."""
    k = 256 in (quant_type(q13).block_weights, quant_type(q2).block_weights)
    H, inter = (256, 256) if k else (128, 96)
    g = torch.Generator().manual_seed(seed)
    w13 = random_blocks((experts, 2 * inter, H), q13, g, std=H**-0.5)
    w2 = random_blocks((experts, H, inter), q2, g, std=inter**-0.5)
    return w13, w2, H, inter


def routing(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, top_k, generator=g) + 0.1


@pytest.mark.parametrize(("q13", "q2"), PAIRS, ids=IDS)
def test_grouped_gemm_matches_gguf_and_reference(q13: str, q2: str) -> None:
    """More pairs than a tile holds for one expert (70 tokens, 4 experts, top 2: ~35 pairs an expert, and 64-pair
    tiles of 8 warps' kernels would hold them; the interpreter uses 16-pair tiles to cross tiles)."""
    E, K = 4, 2
    w13, w2, H, inter = banks(q13, q2, E, seed=11)
    x, ids, wts = routing(70, H, E, K, seed=12)
    d13, d2 = gguf_dense(w13, q13), gguf_dense(w2, q2)
    ref = np.zeros((70, H))
    for t, k in np.ndindex(*ids.shape):
        e = int(ids[t, k])
        gate, up = np.split(d13[e] @ x[t].double().numpy(), 2)
        ref[t] += float(wts[t, k]) * (d2[e] @ (gate / (1 + np.exp(-gate)) * up))
    tiles = QuantTiles(m=16, n=64, warps=4)
    y = quant_pair_outputs(x.to(DEVICE), ids.flatten().to(DEVICE), wts.flatten().to(DEVICE), w13.to(DEVICE),
                           w2.to(DEVICE), q13, q2, tiles=tiles)  # fmt: skip
    out = y.view(70, K, H).sum(dim=1)
    assert rel(out, torch.from_numpy(ref)) < 1e-5
    plain = quant_experts_reference(x, ids, wts, w13, w2, q13, q2, inter, H)
    kernel = quant_grouped_gemm(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), q13, q2)
    assert rel(kernel, plain) < 1e-5


def test_skipped_pairs_and_waves_are_bitwise_the_whole_launch() -> None:
    """Rows -1 leave a pair's output untouched; computing the experts in two waves (the other wave's pairs skipped)
    from rows elsewhere in a larger pool gives bitwise the one-launch result: how offloaded prefill equals resident."""
    q13, q2, E, K = "Q4_K", "Q6_K", 4, 2
    w13, w2, H, inter = banks(q13, q2, E, seed=21)
    x, ids, wts = routing(40, H, E, K, seed=22)
    x, ids, wts, w13, w2 = (t.to(DEVICE) for t in (x, ids, wts, w13, w2))
    tiles = QuantTiles(m=16, n=64, warps=4)
    whole = quant_pair_outputs(x, ids.flatten(), wts.flatten(), w13, w2, q13, q2, tiles=tiles)
    # a pool of 7 slots holding the experts at slots 5, 1, 6, 2
    slot_of = torch.tensor([5, 1, 6, 2], device=DEVICE)
    pool13 = torch.zeros(7, *w13.shape[1:], dtype=torch.uint8, device=DEVICE)
    pool2 = torch.zeros(7, *w2.shape[1:], dtype=torch.uint8, device=DEVICE)
    pool13[slot_of], pool2[slot_of] = w13, w2
    y = torch.full_like(whole, float("nan"))
    flat = ids.flatten()
    for wave in ([0, 3], [1, 2]):
        in_wave = torch.isin(flat, torch.tensor(wave, device=DEVICE))
        rows = torch.where(in_wave, slot_of[flat], -1)
        quant_pair_outputs(x, rows, wts.flatten(), pool13, pool2, q13, q2, out=y, tiles=tiles)
        if wave == [0, 3]:
            assert torch.isnan(y[~in_wave]).all()
    assert torch.equal(y, whole)


def test_gate_up_reads_its_own_rows_for_a_ragged_inter() -> None:
    """I not a whole number of 64-row tiles (I = 96 with Q8_0 up and Q4_0 down): the clamped rows are never stored."""
    E, K = 3, 2
    g = torch.Generator().manual_seed(5)
    H, inter = 128, 96
    w13 = random_blocks((E, 2 * inter, H), "Q8_0", g, std=H**-0.5)
    w2 = random_blocks((E, H, inter), "Q4_0", g, std=inter**-0.5)
    x, ids, wts = routing(9, H, E, K, seed=6)
    ref = quant_experts_reference(x, ids, wts, w13, w2, "Q8_0", "Q4_0", inter, H)
    out = quant_grouped_gemm(x.to(DEVICE), ids.to(DEVICE), wts.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), "Q8_0",
                             "Q4_0")  # fmt: skip
    assert rel(out, ref) < 1e-5
