"""The Gated DeltaNet decode kernels (`edgemoe.kernels.gated_delta`) compiled on CUDA against the layer's plain-torch
step (`GatedDeltaNet._decode`) at Qwen3-Next's geometry and small ones, fp32 and bf16, grouped and tiled, states in a
StateCache pool; batch invariance; no host sync once compiled; and replayed from a CUDA graph with new inputs copied
into its static buffers, bitwise equal to eager calls from the same states.

Tolerances as tests/kernels/test_gated_delta.py says; on the GPU rsqrt and exp are the hardware's approximations
(an ulp or two), well inside fp32's 1e-5 relative."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.gated_delta import conv_decode, delta_rule_decode
from edgemoe.layers.kernels import select_kernels
from edgemoe.layers.linear_attention import conv_step, recurrent_step
from tests.gpu.sync_free import host_sync_forbidden
from tests.kernels.test_gated_delta import (
    FP32,
    assert_half_close,
    assert_within_bf16_channels,
    kernel_step,
    make_layers,
    run_both,
    states,
    step_inputs,
)

# (k_heads, v_heads, k_dim, v_dim)
GEOMETRIES = {
    "qwen3-next": (16, 32, 128, 128),  # channels 8192
    "v=k": (4, 4, 64, 64),
    "dk48-dv96": (2, 4, 48, 96),  # dims off powers of two
}
SLOTS = 16


@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_float32_matches_reference(geometry, tiled: bool, batch: int) -> None:
    layers, cache = make_layers(geometry, torch.float32, tiled, seed=batch, device="cuda", slots=SLOTS)
    slots = torch.randperm(SLOTS, device="cuda")[:batch]
    before, ref, ref_pool, out, pool = run_both(layers, cache, slots, torch.float32)
    torch.testing.assert_close(out, ref, **FP32)
    conv, rec = states(layers[0], cache, pool)
    ref_conv, ref_rec = states(layers[0], cache, ref_pool)
    assert torch.equal(conv, ref_conv)
    torch.testing.assert_close(rec, ref_rec, **FP32)
    untouched = torch.ones(SLOTS + 1, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.equal(states(layers[1], cache, pool)[1], states(layers[1], cache, before)[1])


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_bfloat16_stages_match_references(geometry, tiled: bool, batch: int) -> None:
    layers, _ = make_layers(geometry, torch.bfloat16, tiled, seed=100 + batch, device="cuda", slots=SLOTS)
    layer = layers[0]
    slots = torch.randperm(SLOTS, device="cuda")[:batch]
    mixed, b, a = step_inputs(layer, batch, torch.bfloat16)
    with torch.no_grad():
        beta, g = layer.gates(b, a)
    conv, rec = layer.conv_state[slots].clone(), layer.recurrent_state[slots].clone()
    weight = layer.conv1d.weight.detach()
    channels = conv_decode(mixed, weight, layer.conv_state, slots)
    ref_channels, ref_conv = conv_step(mixed, conv, weight)
    assert torch.equal(layer.conv_state[slots], ref_conv)
    assert_half_close(channels, ref_channels)
    out = delta_rule_decode(channels, b, a, layer.A, layer.dt_bias, layer.recurrent_state, slots, layer.k_heads, tiled)
    ref_out, ref_rec = recurrent_step(*layer._heads(channels), g, beta, rec)
    torch.testing.assert_close(layer.recurrent_state[slots], ref_rec, **FP32)
    assert_half_close(out, ref_out)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_bfloat16_step_matches_reference(tiled: bool) -> None:
    layers, cache = make_layers(GEOMETRIES["qwen3-next"], torch.bfloat16, tiled, seed=4, device="cuda", slots=SLOTS)
    slots = torch.randperm(SLOTS, device="cuda")[:4]
    _, ref, ref_pool, out, pool = run_both(layers, cache, slots, torch.bfloat16)
    (conv, rec), (ref_conv, ref_rec) = states(layers[0], cache, pool), states(layers[0], cache, ref_pool)
    assert torch.equal(conv, ref_conv)
    assert_within_bf16_channels(out, ref)
    assert_within_bf16_channels(rec, ref_rec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariance(dtype: torch.dtype) -> None:
    """A sequence's output and states are bitwise the same alone and in a batch of 4 (and of 8)."""
    layers, cache = make_layers(GEOMETRIES["qwen3-next"], dtype, False, seed=5, device="cuda", slots=SLOTS)
    layer = layers[0]
    mixed, b, a = step_inputs(layer, 8, dtype)
    slots = torch.randperm(SLOTS, device="cuda")[:8]
    before = cache.pool.clone()
    for batch in (4, 8):
        cache.pool.copy_(before)
        together = kernel_step(layer, mixed[:batch], b[:batch], a[:batch], slots[:batch])
        together_pool = cache.pool.clone()
        for i in range(batch):
            cache.pool.copy_(before)
            alone = kernel_step(layer, mixed[i : i + 1], b[i : i + 1], a[i : i + 1], slots[i : i + 1])
            assert torch.equal(alone[0], together[i])
            assert torch.equal(cache.pool[slots[i]], together_pool[slots[i]])


def test_no_host_sync_once_compiled() -> None:
    layers, _ = make_layers(GEOMETRIES["qwen3-next"], torch.bfloat16, False, seed=6, device="cuda", slots=SLOTS)
    layer = layers[0]
    mixed, b, a = step_inputs(layer, 2, torch.bfloat16)
    slots = torch.tensor([3, 9], device="cuda")
    kernel_step(layer, mixed, b, a, slots)  # compiles (may sync)
    with torch.cuda.device(mixed.device), host_sync_forbidden():
        kernel_step(layer, mixed, b, a, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype) -> None:
    """The step captured once over static buffers (the projections' outputs, the slots), replayed twice
    with new inputs copied in: bitwise the eager kernel from the same states, and within tolerance of the reference;
    the layer chooses the kernel through `select_kernels`."""
    layers, cache = make_layers(GEOMETRIES["qwen3-next"], dtype, True, seed=7, device="cuda", slots=SLOTS)
    layer = layers[0]
    select_kernels(layer, torch.device("cuda"))
    assert layer._decode_kernel is not None
    batch = 4
    mixed, b, a = step_inputs(layer, batch, dtype)
    slots = torch.tensor([1, 12, 5, 8], device="cuda")
    weight = layer.conv1d.weight.detach()

    def step() -> torch.Tensor:
        return layer._decode_kernel(
            mixed, b, a, layer.A, layer.dt_bias, slots, weight, layer.conv_state, layer.recurrent_state,
            layer.k_heads, layer.tiled,
        )  # fmt: skip

    graph, out = capture_graph(step)
    for seed in (1, 2):
        torch.manual_seed(seed)
        new = step_inputs(layer, batch, dtype)
        for buffer, value in zip((mixed, b, a), new):
            buffer.copy_(value)
        slots.copy_(torch.randperm(SLOTS, device="cuda")[:batch])
        before = cache.pool.clone()
        out.fill_(float("nan"))
        graph.replay()
        replayed, replayed_pool = out.clone(), cache.pool.clone()
        cache.pool.copy_(before)
        eager = step()
        assert torch.equal(replayed, eager) and torch.equal(replayed_pool, cache.pool)
        cache.pool.copy_(before)
        with torch.no_grad():
            ref = layer._decode(mixed, *layer.gates(b, a), slots)
        if dtype == torch.float32:
            torch.testing.assert_close(replayed, ref, **FP32)
        else:
            assert_within_bf16_channels(replayed, ref)
        cache.pool.copy_(replayed_pool)  # the next replay goes on from the graph's states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_norm_matches_reference(dtype: torch.dtype) -> None:
    """The output's gated RMSNorm (`gated_rms_norm`, one launch) against `GatedRMSNorm.reference` on torch's CUDA ops
    at Qwen3-Next's 32 value heads of 128, 8 sequences: fp32 to 1e-5, bf16 within an ulp and rarely off."""
    from edgemoe.kernels.norm_rope import gated_rms_norm
    from edgemoe.layers.linear_attention import GatedRMSNorm

    g = torch.Generator(device="cuda").manual_seed(9)
    x, z = (
        (3 * torch.randn(8 * 32, 128, generator=g, device="cuda")).to(dtype),
        torch.randn(8 * 32, 128, generator=g, device="cuda").to(dtype),
    )
    norm = GatedRMSNorm(128, 1e-6).to("cuda", dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(128, generator=g, device="cuda")).to(dtype)
    out, ref = gated_rms_norm(x, z, norm.weight, 1e-6), norm.reference(x, z)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert_half_close(out, ref)
