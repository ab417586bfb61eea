"""The Gated DeltaNet prefill kernel (`edgemoe.kernels.gated_delta_prefill`) compiled on CUDA against the layer's
plain-torch prefill (`chunked_delta_rule` per sequence) at Qwen3-Next's geometry over 4K tokens and at small geometries
with dims off powers of two, fp32 and bf16, grouped and tiled, one sequence and a batch of ragged ones, states in a
StateCache pool; no host sync once compiled; replayed from a CUDA graph with new inputs (and new sequence lengths)
copied into its static buffers, bitwise equal to eager calls from the same states; the layer's prefill on the kernel.

Tolerances. fp32: the kernel's products are IEEE fp32 as cuBLAS's (tf32 off, tests/gpu/conftest.py), summed in
other orders, and exp and rsqrt are the hardware's approximations; the state carries the differences over the
sequence's 64 chunks: within 1e-4 relative. bf16: the kernel's products take TF32 operands (10-bit mantissas), the
reference's fp32 ones: outputs within bf16's resolution of their scale, states within 2^-9 of theirs."""

from __future__ import annotations

import pytest
import torch

from edgemoe.context import ForwardContext
from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.gated_delta_prefill import delta_rule_prefill
from edgemoe.layers.kernels import select_kernels
from tests.gpu.sync_free import host_sync_forbidden
from tests.kernels.test_gated_delta import (
    assert_within_bf16_channels,
    make_layers,
    randomize,
    reference_then_kernels,
    states,
)
from tests.kernels.test_gated_delta_prefill import chunked, cu_seqlens, prefill_inputs, run_kernel

QWEN3_NEXT = (16, 32, 128, 128)  # (k_heads, v_heads, k_dim, v_dim)
SMALL = {"dk48-dv96": (2, 4, 48, 96), "dk16-dv8": (2, 4, 16, 8)}
SLOTS = 8
LONG = dict(rtol=1e-4, atol=1e-5)
BATCH = [3000, 64, 1, 1031]  # 4096 tokens: ragged, one chunk, one token


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, state: bool = False) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **LONG)
    elif state:
        scale = ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=2**-9, atol=2**-9 * scale)
    else:
        assert_within_bf16_channels(out, ref)


def compare(geometry, dtype: torch.dtype, tiled: bool, lens: list[int], seed: int) -> None:
    layers, cache = make_layers(geometry, dtype, tiled, seed=seed, device="cuda", slots=SLOTS)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, sum(lens), dtype)
    slots = torch.randperm(SLOTS, device="cuda")[: len(lens)]
    before, start = cache.pool.clone(), layer.recurrent_state.clone()
    out = run_kernel(layer, channels, beta, g, lens, slots)
    ref, ref_state = chunked(layer, channels, beta, g, lens, slots, start)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)
    assert_close(layer.recurrent_state, ref_state, dtype, state=True)
    untouched = torch.ones(SLOTS + 1, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(cache.pool[untouched], before[untouched])
    # at the batch's slots too, the convolution states and the other layer's states are as they were
    assert torch.equal(layer.conv_state, states(layer, cache, before)[0])
    for view, was in zip(states(layers[1], cache, cache.pool), states(layers[1], cache, before)):
        assert torch.equal(view, was)


@pytest.mark.parametrize("lens", [[4096], BATCH], ids=["one", "batch"])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen3_next_matches_reference(dtype: torch.dtype, tiled: bool, lens: list[int]) -> None:
    compare(QWEN3_NEXT, dtype, tiled, lens, seed=len(lens) + 2 * tiled)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("geometry", SMALL.values(), ids=SMALL.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_geometries_match_reference(dtype: torch.dtype, geometry, tiled: bool) -> None:
    compare(geometry, dtype, tiled, [200, 64, 5], seed=sum(geometry))


def test_no_host_sync_once_compiled() -> None:
    layers, _ = make_layers(QWEN3_NEXT, torch.bfloat16, False, seed=6, device="cuda", slots=SLOTS)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, 300, torch.bfloat16)
    slots, cu = torch.tensor([3, 5], device="cuda"), cu_seqlens([200, 100], "cuda")
    args = (channels, beta, g, layer.recurrent_state, slots, cu, 200, layer.k_heads, layer.tiled)
    delta_rule_prefill(*args)  # compiles (may sync)
    with torch.cuda.device(channels.device), host_sync_forbidden():
        delta_rule_prefill(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype) -> None:
    """Captured once over static buffers (channels, beta, g, slots, cu_seqlens; the grid covers sequences of up to
    4096 tokens), replayed with new inputs, slots and lengths copied in: bitwise the eager kernel from the same
    states, and within tolerance of the reference."""
    layers, cache = make_layers(QWEN3_NEXT, dtype, True, seed=7, device="cuda", slots=SLOTS)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, 4096, dtype)
    slots, cu = torch.tensor([1, 4], device="cuda"), cu_seqlens([3000, 1096], "cuda")

    def prefill() -> torch.Tensor:
        return delta_rule_prefill(channels, beta, g, layer.recurrent_state, slots, cu, 4096, layer.k_heads, True)

    graph, out = capture_graph(prefill)
    for seed, lens in ((1, [1096, 3000]), (2, [4096, 0])):
        torch.manual_seed(seed)
        for buffer, value in zip((channels, beta, g), prefill_inputs(layer, 4096, dtype)):
            buffer.copy_(value)
        slots.copy_(torch.randperm(SLOTS, device="cuda")[:2])
        cu.copy_(cu_seqlens(lens, "cuda"))
        before = cache.pool.clone()
        start = layer.recurrent_state.clone()
        out.fill_(float("nan"))
        graph.replay()
        replayed, replayed_pool = out.clone(), cache.pool.clone()
        cache.pool.copy_(before)
        assert torch.equal(prefill(), replayed) and torch.equal(cache.pool, replayed_pool)
        ref, ref_state = chunked(layer, channels, beta, g, lens, slots, start)
        assert_close(replayed, ref, dtype)
        assert_close(layer.recurrent_state, ref_state, dtype, state=True)


def test_layer_prefills_on_the_kernel() -> None:
    """`select_kernels` gives the layer the kernel; its forward under a prefill context of three sequences matches
    the reference layer's: outputs and both states at the slots."""
    layers, cache = make_layers(QWEN3_NEXT, torch.float32, False, seed=8, device="cuda", slots=SLOTS)
    layer = layers[0]
    hidden = layer.in_proj_qkv.weight.shape[1]
    randomize(layer)
    lens = [700, 3, 130]
    x = torch.randn(sum(lens), hidden, device="cuda")
    slots = torch.tensor([5, 0, 2], device="cuda")
    context = ForwardContext(True, torch.empty(0), torch.ones(3), torch.zeros(3, 1), query_lens=lens,
                             state_slots=slots)  # fmt: skip
    ref, ref_pool, out, pool = reference_then_kernels(layer, cache, x, context,
                                                      lambda m: select_kernels(m, torch.device("cuda")))  # fmt: skip
    assert layer._prefill_kernel is delta_rule_prefill
    torch.testing.assert_close(out, ref, **LONG)
    torch.testing.assert_close(pool.view(torch.float32), ref_pool.view(torch.float32), **LONG)
