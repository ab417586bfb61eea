"""The prefill grouped GEMM (`edgemoe.kernels.grouped_gemm`) compiled on CUDA at real geometries: against the
plain-torch path (`prefill_reference`) and a float32 reference, bitwise the same run to run and when run in waves over a
slot pool, without host synchronisation.

Tolerances: float32 (IEEE dots, as torch's matmul without TF32) within 1e-4 of `prefill_reference`; bf16/fp16 within
1e-2 relative (Frobenius) of the float32 reference and no more than 1.5x as far as the torch path in the same dtype."""

from __future__ import annotations

import pytest
import torch

from edgemoe.kernels.grouped_gemm import grouped_gemm, pair_outputs
from edgemoe.moe.experts import prefill_reference
from tests.gpu.sync_free import host_sync_forbidden
from tests.gpu.test_moe_gemv_gpu import inputs  # random experts and routing, as decode's tests draw them

# name -> (hidden, inter, top_k, experts)
GEOMETRIES = {
    "qwen3-30b-a3b": (2048, 768, 8, 128),
    "qwen1.5-moe-a2.7b": (2048, 1408, 4, 60),
    "demo": (256, 48, 4, 32),
}
CASES = [("qwen3-30b-a3b", 512), ("qwen3-30b-a3b", 4096), ("qwen1.5-moe-a2.7b", 512), ("demo", 37), ("demo", 1)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name, tokens", CASES)
def test_float32_matches_torch(name: str, tokens: int) -> None:
    x, ids, weights, w13, w2 = inputs(*GEOMETRIES[name], tokens, torch.float32, seed=tokens)
    out = grouped_gemm(x, ids, weights, w13, w2)
    expected = prefill_reference(x, ids, weights, w13, w2)
    assert out.dtype == torch.float32 and rel(out, expected) < 1e-5
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, tokens", CASES)
def test_half_precision_no_worse_than_torch(name: str, tokens: int, dtype: torch.dtype) -> None:
    x, ids, weights, w13, w2 = inputs(*GEOMETRIES[name], tokens, dtype, seed=tokens + 1)
    ref = prefill_reference(x.float(), ids, weights.float(), w13.float(), w2.float())
    out = grouped_gemm(x, ids, weights, w13, w2)
    assert out.dtype == dtype
    err, torch_err = rel(out, ref), rel(prefill_reference(x, ids, weights, w13, w2), ref)
    assert err < 1e-2 and err <= 1.5 * torch_err + 1e-4, (err, torch_err)


def test_one_hot_expert_and_empty_experts() -> None:
    """Every token routes to expert 0 (many tiles of one expert) and to few others; most experts get nothing."""
    x, ids, weights, w13, w2 = inputs(*GEOMETRIES["qwen3-30b-a3b"], 1024, torch.bfloat16, seed=9)
    ids = torch.arange(8, device="cuda").expand(1024, 8).contiguous()  # experts 0-7 only, each with 1024 pairs
    ref = prefill_reference(x.float(), ids, weights.float(), w13.float(), w2.float())
    assert rel(grouped_gemm(x, ids, weights, w13, w2), ref) < 1e-2


@pytest.mark.parametrize("name, tokens", CASES[:3])
def test_bitwise_the_same_run_to_run_and_without_host_sync(name: str, tokens: int) -> None:
    x, ids, weights, w13, w2 = inputs(*GEOMETRIES[name], tokens, torch.bfloat16, seed=3)
    first = grouped_gemm(x, ids, weights, w13, w2)  # compiled before the sync check
    torch.cuda.synchronize()
    with host_sync_forbidden():
        second = grouped_gemm(x, ids, weights, w13, w2)
    assert torch.equal(first, second)


def test_waves_over_a_slot_pool_are_bitwise_one_launch() -> None:
    """As offloaded prefill runs it: experts in waves of 48, read from shuffled rows of a pool of slots, each wave
    skipping the other waves' pairs, give bitwise the pair outputs of one launch over the bank."""
    x, ids, weights, w13, w2 = inputs(*GEOMETRIES["qwen3-30b-a3b"], 512, torch.bfloat16, seed=4)
    flat, w = ids.flatten(), weights.flatten()
    want = pair_outputs(x, flat, w, w13, w2)
    E, S = w13.shape[0], 48
    y = torch.empty_like(want)
    pool13, pool2 = torch.empty_like(w13[: S + 1]), torch.empty_like(w2[: S + 1])
    for start in range(0, E, S):
        wave = torch.arange(start, min(start + S, E), device="cuda")
        slots = torch.randperm(S, device="cuda")[: wave.numel()]
        pool13[slots], pool2[slots] = w13[wave], w2[wave]
        slot_of = torch.full((E,), -1, device="cuda")
        slot_of[wave] = slots
        pair_outputs(x, slot_of[flat], w, pool13, pool2, out=y)
    assert torch.equal(y, want)
