"""Quantized weights on CUDA at qwen3-30b-a3b's shapes, fresh random blocks of every format: the device dequantization
bitwise the plain-torch reference (float32, and rounded to bf16 as torch rounds); quantized prefill in waves against
the reference and bitwise the same whatever the waves; decode's dense GEMV on blocks (`quant_linear`) against the
reference, replayed from a CUDA graph, a token's row bitwise the same at every batch size.

Tolerances: bf16 rounds the weights (prefill), x and h (2^-9 relative each), so 2e-2 relative in norm; the float32
GEMV sums 2048 products in float32 (1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.dequant import dequantize_rows, quant_pair_outputs
from edgemoe.kernels.quant_gemv import quant_experts_reference, quant_linear
from edgemoe.quant import QUANT_TYPES, dequantize, random_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, INTER, TOP_K, E = 2048, 768, 8, 16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_dequantize_bitwise_on_cuda(name: str) -> None:
    g = torch.Generator().manual_seed(1)
    bank = random_blocks((4, 2 * INTER, H), name, g, std=H**-0.5).cuda()
    idx = torch.tensor([2, 0], device="cuda")
    ref = dequantize(bank[idx], name, H)
    assert torch.equal(dequantize_rows(bank, idx, name, H, dtype=torch.float32), ref)
    assert torch.equal(dequantize_rows(bank, idx, name, H, dtype=torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize(("q13", "q2"), [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("MXFP4", "MXFP4"), ("Q5_K", "Q5_K")])
def test_prefill_in_waves(q13: str, q2: str) -> None:
    g = torch.Generator().manual_seed(2)
    w13 = random_blocks((E, 2 * INTER, H), q13, g, std=H**-0.5).cuda()
    w2 = random_blocks((E, H, INTER), q2, g, std=INTER**-0.5).cuda()
    x = torch.randn(300, H, device="cuda").bfloat16()
    ids = torch.rand(300, E, device="cuda").argsort(dim=-1)[:, :TOP_K]
    wts = torch.rand(300, TOP_K, device="cuda")
    whole = quant_pair_outputs(x, ids.flatten(), wts.flatten(), w13, w2, q13, q2)
    assert torch.equal(quant_pair_outputs(x, ids.flatten(), wts.flatten(), w13, w2, q13, q2, wave=3), whole)
    sub = slice(0, 16)  # the reference dequantizes every pair's expert: a few tokens of it
    ref = quant_experts_reference(x[sub], ids[sub], wts[sub], w13, w2, q13, q2, INTER, H)
    assert rel(whole.view(300, TOP_K, H)[sub].float().sum(dim=1), ref) < 2e-2


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_dense_gemv_replays_and_is_batch_invariant(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = random_blocks((1000, H), name, g, std=H**-0.5).cuda()  # 1000 rows: not a whole number of tiles
    x32 = torch.randn(8, H, device="cuda")
    assert rel(quant_linear(x32, w, name), F.linear(x32, dequantize(w, name, H))) < 1e-5
    x = x32.bfloat16()
    out = torch.empty(8, 1000, device="cuda", dtype=torch.bfloat16)
    graph, _ = capture_graph(lambda: quant_linear(x, w, name, out=out))
    for _ in range(2):
        x.copy_(torch.randn(8, H, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, quant_linear(x, w, name))
        alone = quant_linear(x[:1], w, name)
        assert torch.equal(out[:1], alone) and torch.equal(quant_linear(x[:4], w, name)[:1], alone)
