"""The quantized matrix kernels (`edgemoe.kernels.quant_gemm`) compiled on CUDA at qwen3-30b-a3b's shapes, on fresh
random blocks: the dense quantized matmul and the tensor-core decode experts against the plain-torch references in
float32 and bf16, replayed from a CUDA graph with new inputs, rows bitwise the same at every decode batch size; the
prefill grouped GEMM against the reference, without host synchronisation, and bitwise the same computed in waves from
other rows of a pool (how offloaded prefill equals resident).

Tolerances: float32 keeps float32 weights and IEEE dots (1e-5 relative, as tests/kernels/test_quant_gemm.py, whose
sums were shorter); bf16 rounds the dequantized weights and the activations (2^-9 relative each) and h, so 2e-2
relative in norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.quant_gemm import DECODE_TILES, quant_decode_experts, quant_matmul, quant_pair_outputs
from edgemoe.kernels.quant_gemv import quant_experts_reference
from edgemoe.layers.quant import QUANT_TYPES, dequantize, random_blocks
from tests.gpu.sync_free import host_sync_forbidden

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, INTER, TOP_K, E = 2048, 768, 8, 16
PAIRS = [(name, name) for name in QUANT_TYPES] + [("Q4_K", "Q6_K")]
IDS = [a if a == b else f"{a}+{b}" for a, b in PAIRS]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(QUANT_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_at_decode_and_prefill_sizes(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = random_blocks((1000, H), name, g, std=H**-0.5).cuda()  # 1000 rows: not a whole number of tiles
    dense = dequantize(w, name, H)
    for tokens in (1, 5, 300):
        x = torch.randn(tokens, H, device="cuda").to(dtype)
        ref = F.linear(x.float(), dense)
        assert rel(quant_matmul(x, w, name), ref) < TOL[dtype], tokens


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4"])
def test_decode_matmul_replays_and_is_batch_invariant(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = random_blocks((4096, H), name, g, std=H**-0.5).cuda()
    x = torch.empty(8, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
    x.copy_(torch.randn(8, H))
    quant_matmul(x, w, name, out=out, tiles=DECODE_TILES)  # compiled before capture
    graph, _ = capture_graph(lambda: quant_matmul(x, w, name, out=out, tiles=DECODE_TILES))
    for _ in range(2):
        x.copy_(torch.randn(8, H))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, quant_matmul(x, w, name, tiles=DECODE_TILES))
        alone = quant_matmul(x[:1], w, name, tiles=DECODE_TILES)
        assert torch.equal(out[:1], alone) and torch.equal(quant_matmul(x[:4], w, name, tiles=DECODE_TILES)[:1], alone)


def banks(q13: str, q2: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = random_blocks((E, 2 * INTER, H), q13, g, std=H**-0.5).cuda()
    w2 = random_blocks((E, H, INTER), q2, g, std=INTER**-0.5).cuda()
    return w13, w2


def routing(tokens: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, device="cuda").to(dtype)
    ids = torch.rand(tokens, E, generator=g, device="cuda").argsort(dim=-1)[:, :TOP_K]
    return x, ids, torch.rand(tokens, TOP_K, generator=g, device="cuda")


@pytest.mark.parametrize(("q13", "q2"), PAIRS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_experts_match_reference_and_replay(q13: str, q2: str, dtype: torch.dtype) -> None:
    w13, w2 = banks(q13, q2, 3)
    x, ids, wts = routing(4, dtype, 4)
    ref = quant_experts_reference(x, ids, wts, w13, w2, q13, q2, INTER, H)
    out = quant_decode_experts(x, ids, wts, w13, w2, q13, q2)
    assert rel(out, ref) < TOL[dtype]
    graph, _ = capture_graph(lambda: out.copy_(quant_decode_experts(x, ids, wts, w13, w2, q13, q2)))
    x2, ids2, wts2 = routing(4, dtype, 5)
    x.copy_(x2), ids.copy_(ids2), wts.copy_(wts2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, quant_decode_experts(x, ids, wts, w13, w2, q13, q2))


@pytest.mark.parametrize(("q13", "q2"), [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("MXFP4", "MXFP4"), ("Q5_K", "Q5_K")])
def test_prefill_grouped_gemm_matches_and_waves_are_bitwise(q13: str, q2: str) -> None:
    w13, w2 = banks(q13, q2, 6)
    x, ids, wts = routing(300, torch.bfloat16, 7)
    flat = ids.flatten()
    with host_sync_forbidden():
        whole = quant_pair_outputs(x, flat, wts.flatten(), w13, w2, q13, q2)
    out = whole.view(300, TOP_K, H).sum(dim=1, dtype=torch.float32)
    assert rel(out, quant_experts_reference(x, ids, wts, w13, w2, q13, q2, INTER, H)) < TOL[torch.bfloat16]
    # the same experts at other rows of a larger pool, computed in two waves
    slot_of = torch.randperm(2 * E, device="cuda")[:E]
    pool13 = torch.zeros(2 * E, *w13.shape[1:], dtype=torch.uint8, device="cuda")
    pool2 = torch.zeros(2 * E, *w2.shape[1:], dtype=torch.uint8, device="cuda")
    pool13[slot_of], pool2[slot_of] = w13, w2
    y = torch.full_like(whole, float("nan"))
    for wave in (torch.arange(0, E, 2, device="cuda"), torch.arange(1, E, 2, device="cuda")):
        rows = torch.where(torch.isin(flat, wave), slot_of[flat], -1)
        quant_pair_outputs(x, rows, wts.flatten(), pool13, pool2, q13, q2, out=y)
    assert torch.equal(y, whole)
