"""The Gated DeltaNet decode kernels (`edgemoe.kernels.gated_delta`, Triton's interpreter on CPU) against the layer's
plain-torch step (`GatedDeltaNet._decode`: `conv_step`, `recurrent_step`, index_copy_ back) on fresh random inputs
and states: fp32 and bf16, grouped and tiled value heads, one or two value heads per q/k head, head dims off powers
of two, states in a StateCache pool (strided slot views beside another layer's), non-contiguous slots, int32 slots.

Tolerances. The convolution state is a shifted copy: bitwise. The convolution sums its taps in order in fp32 and
rounds where torch rounds; torch's CPU conv1d may sum in another order and SiLU's exp differs by an ulp, so a bf16
channel may round to its neighbour, rarely. The delta rule sums over k_dim in another order than torch's, and rsqrt
and exp may differ by an ulp or two: fp32 results within 1e-5 relative (a few ulps through the decay, the
correction and the read). A bf16 output rounds those fp32 values once, so it may land one bf16 ulp off, rarely.
Through the whole step in bf16, a channel rounded to its neighbour (2^-8 relative) moves its head's normalised q
or k, so the whole step is held only to bf16's resolution there; each stage is held tightly on the other's output."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from edgemoe.context import ForwardContext, set_context
from edgemoe.engine.state_cache import StateCache
from edgemoe.kernels import gated_delta
from edgemoe.kernels.gated_delta import conv_decode, delta_rule_decode, gated_delta_decode
from edgemoe.kernels.gated_delta_prefill import delta_rule_prefill
from edgemoe.kernels.norm_rope import gated_rms_norm
from edgemoe.layers import linear_attention
from edgemoe.layers.linear_attention import GatedDeltaNet, conv_step, recurrent_step
from tests.kernels import interpreter_only

pytestmark = interpreter_only

SLOTS = 8  # the pool's slots, plus its pad slot
FP32 = dict(rtol=1e-5, atol=1e-6)

# (k_heads, v_heads, k_dim, v_dim); (2, 4, 16, 8) is the tiny hybrid checkpoints' (tests/conftest.py)
GEOMETRIES = [(2, 2, 16, 16), (2, 4, 16, 8), (2, 4, 32, 48), (1, 2, 48, 32), (2, 4, 128, 128)]


def make_layers(
    geometry: tuple[int, ...], dtype: torch.dtype, tiled: bool, seed: int, device: str = "cpu", slots: int = SLOTS
) -> tuple[nn.ModuleList, StateCache]:
    """Two layers whose states share one StateCache pool (each slot's row holds both), random weights and states."""
    torch.manual_seed(seed)
    k_heads, v_heads, k_dim, v_dim = geometry
    layers = nn.ModuleList(GatedDeltaNet(32, k_heads, v_heads, k_dim, v_dim, 4, 1e-6, tiled=tiled) for _ in range(2))
    layers.to(device, dtype)
    cache = StateCache(layers, slots, dtype, torch.device(device))
    with torch.no_grad():
        for layer in layers:
            layer.conv1d.weight.copy_(0.5 * torch.randn_like(layer.conv1d.weight))
            layer.conv_state.copy_(torch.randn(layer.conv_state.shape, device=device))
            layer.recurrent_state.copy_(0.5 * torch.randn(layer.recurrent_state.shape, device=device))
    return layers, cache


def step_inputs(layer: GatedDeltaNet, seqs: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """in_proj_qkv's output and the gate projections' b and a (the model's dtype) of one decode step; the layer's
    decay rates A and dt_bias drawn afresh (a few a's past softplus' threshold of 20)."""
    device = layer.conv1d.weight.device
    mixed = torch.randn(seqs, layer.channels, device=device).to(dtype)
    b = (2 * torch.randn(seqs, layer.v_heads, device=device)).to(dtype)
    a = (3 * torch.randn(seqs, layer.v_heads, device=device)).to(dtype)
    a[0, 0] = 24.0
    with torch.no_grad():
        layer.A.copy_(-torch.rand(layer.v_heads, device=device))  # fp32, as -exp(A_log)
        layer.dt_bias.copy_(torch.randn(layer.v_heads, device=device))
    return mixed, b, a


def kernel_step(layer: GatedDeltaNet, mixed, b, a, slots) -> torch.Tensor:
    return gated_delta_decode(
        mixed, b, a, layer.A.detach(), layer.dt_bias.detach(), slots, layer.conv1d.weight.detach(), layer.conv_state,
        layer.recurrent_state, layer.k_heads, layer.tiled,
    )  # fmt: skip


def run_both(layers: nn.ModuleList, cache: StateCache, slots: torch.Tensor, dtype: torch.dtype):
    """One decode step of layers[0] from the same pool by the reference and by the kernel -> (pool before, ref out,
    ref pool, kernel out, kernel pool)."""
    layer = layers[0]
    mixed, b, a = step_inputs(layer, slots.shape[0], dtype)
    before = cache.pool.clone()
    with torch.no_grad():
        ref = layer._decode(mixed, *layer.gates(b, a), slots.long())
    ref_pool = cache.pool.clone()
    cache.pool.copy_(before)
    out = kernel_step(layer, mixed, b, a, slots)
    return before, ref, ref_pool, out, cache.pool.clone()


def states(layer: GatedDeltaNet, cache: StateCache, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's two state views, read from a snapshot of the pool."""
    saved = cache.pool.clone()
    cache.pool.copy_(pool)
    views = layer.conv_state.clone(), layer.recurrent_state.clone()
    cache.pool.copy_(saved)
    return views


def assert_half_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 values computed in fp32 within ~1e-5 and rounded once: one bf16 ulp at most, and rarely."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=torch.finfo(out.dtype).eps, atol=1e-5)
    assert (out == ref).float().mean() >= 0.97


def assert_within_bf16_channels(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The whole bf16 step: a channel rounded to its bf16 neighbour (2^-8 relative) moves its head's normalised q or
    k by at most that much of the head's size, so the outputs and states it feeds by at most ~2^-8 of their scale."""
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-8 * scale)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda s: "k{}-v{}-dk{}-dv{}".format(*s))
def test_decode_step_float32_matches_reference(geometry, tiled: bool) -> None:
    layers, cache = make_layers(geometry, torch.float32, tiled, seed=sum(geometry))
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)  # not contiguous, not sorted, int32
    before, ref, ref_pool, out, pool = run_both(layers, cache, slots, torch.float32)
    conv, rec = states(layers[0], cache, pool)
    ref_conv, ref_rec = states(layers[0], cache, ref_pool)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(rec, ref_rec, **FP32)
    assert torch.equal(conv, ref_conv)
    # only the batch's slots of this layer changed: the other slots and the other layer's states are as they were
    other = torch.ones(SLOTS + 1, dtype=torch.bool)  # (+ the pad slot)
    other[slots.long()] = False
    assert torch.equal(pool[other], before[other])
    assert torch.equal(states(layers[1], cache, pool)[1], states(layers[1], cache, before)[1])
    assert torch.equal(states(layers[1], cache, pool)[0], states(layers[1], cache, before)[0])
    assert not torch.equal(rec[slots.long()], states(layers[0], cache, before)[1][slots.long()])


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("geometry", GEOMETRIES[1:], ids=lambda s: "k{}-v{}-dk{}-dv{}".format(*s))
def test_decode_step_bfloat16_matches_reference(geometry, tiled: bool) -> None:
    layers, cache = make_layers(geometry, torch.bfloat16, tiled, seed=7 + sum(geometry))
    layer, before = layers[0], cache.pool.clone()
    slots = torch.tensor([6, 1, 2, 4])
    mixed, b, a = step_inputs(layer, 4, torch.bfloat16)
    with torch.no_grad():
        beta, g = layer.gates(b, a)
    conv, rec = layer.conv_state[slots].clone(), layer.recurrent_state[slots].clone()
    weight = layer.conv1d.weight.detach()
    # the convolution: its state bitwise, its channels rounded as torch's (an ulp off, rarely)
    channels = conv_decode(mixed, weight, layer.conv_state, slots)
    ref_channels, ref_conv = conv_step(mixed, conv, weight)
    assert torch.equal(layer.conv_state[slots], ref_conv)
    assert_half_close(channels, ref_channels)
    # the delta rule on those channels: fp32 states within 1e-5, outputs rounded once
    out = delta_rule_decode(channels, b, a, layer.A, layer.dt_bias, layer.recurrent_state, slots, layer.k_heads, tiled)
    ref_out, ref_rec = recurrent_step(*layer._heads(channels), g, beta, rec)
    torch.testing.assert_close(layer.recurrent_state[slots], ref_rec, **FP32)
    assert_half_close(out, ref_out)
    # the whole step against `_decode` from the same pool
    cache.pool.copy_(before)
    _, ref, ref_pool, whole, pool = run_both(layers, cache, slots, torch.bfloat16)
    (conv, rec), (ref_conv, ref_rec) = states(layer, cache, pool), states(layer, cache, ref_pool)
    assert torch.equal(conv, ref_conv)
    assert_within_bf16_channels(whole, ref)
    assert_within_bf16_channels(rec, ref_rec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariance(dtype: torch.dtype) -> None:
    """A sequence's output and states are bitwise the same alone and at any row of a batch of 4."""
    layers, cache = make_layers((2, 4, 32, 48), dtype, tiled=False, seed=11)
    layer = layers[0]
    mixed, b, a = step_inputs(layer, 4, dtype)
    slots = torch.tensor([7, 2, 4, 0])
    before = cache.pool.clone()
    batch = kernel_step(layer, mixed, b, a, slots)
    batch_pool = cache.pool.clone()
    for i in range(4):
        cache.pool.copy_(before)
        one = kernel_step(layer, mixed[i : i + 1], b[i : i + 1], a[i : i + 1], slots[i : i + 1])
        assert torch.equal(one[0], batch[i])
        assert torch.equal(cache.pool[slots[i]], batch_pool[slots[i]])


def randomize(layer: GatedDeltaNet) -> None:
    """Fresh random weights (the convolution's aside) and decay rates, so that no stage is an identity."""
    with torch.no_grad():
        for p in layer.parameters():
            if p is not layer.conv1d.weight:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        layer.A.copy_(-torch.rand_like(layer.A))  # a decay rate, as -exp(A_log)


def reference_then_kernels(layer: GatedDeltaNet, cache: StateCache, x: torch.Tensor, context: ForwardContext,
                           choose: Callable[[GatedDeltaNet], None]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The layer's forward under `context` as it is (the references), then from the same states after `choose`
    gave it its kernels -> (reference out, reference pool, out, pool)."""
    set_context(context)
    try:
        before = cache.pool.clone()
        with torch.no_grad():
            ref = layer(x, torch.zeros(len(x)))
        ref_pool = cache.pool.clone()
        cache.pool.copy_(before)
        choose(layer)
        with torch.no_grad():
            out = layer(x, torch.zeros(len(x)))
    finally:
        set_context(None)
    return ref, ref_pool, out, cache.pool


def test_layer_picks_the_kernel_for_decode() -> None:
    """`use_kernels` swaps decode for the kernel; forward under a decode context then matches the reference layer."""
    layers, cache = make_layers((2, 4, 16, 16), torch.float32, tiled=True, seed=3)
    layer = layers[0]
    randomize(layer)
    x, slots = torch.randn(3, 32), torch.tensor([3, 6, 1])
    context = ForwardContext(False, torch.empty(0), torch.ones(3), torch.zeros(3, 1), state_slots=slots)
    # use_kernels: what select_kernels calls on a CUDA device
    ref, ref_pool, out, pool = reference_then_kernels(layer, cache, x, context, lambda m: m.use_kernels("cuda"))
    assert layer._decode_kernel is gated_delta_decode
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(pool.view(torch.float32), ref_pool.view(torch.float32), **FP32)


def test_no_sequences_and_bad_arguments() -> None:
    assert gated_delta.L2_EPS == linear_attention.L2_EPS  # written twice: a kernel imports no layer
    layers, _ = make_layers((2, 4, 16, 16), torch.float32, tiled=False, seed=5)
    layer = layers[0]
    mixed, b, a = step_inputs(layer, 2, torch.float32)
    slots = torch.tensor([0, 1])
    before = layer.recurrent_state.clone()
    out = kernel_step(layer, mixed[:0], b[:0], a[:0], slots[:0])
    assert out.shape == (0, 4, 16) and torch.equal(layer.recurrent_state, before)
    weight = layer.conv1d.weight.detach()
    with pytest.raises(ValueError, match="weight"):
        conv_decode(mixed, weight[:-1], layer.conv_state, slots)
    with pytest.raises(ValueError, match="conv_state"):
        conv_decode(mixed, weight, layer.conv_state[:, :-1], slots)
    with pytest.raises(ValueError, match="q/k heads"):
        delta_rule_decode(mixed, b, a, layer.A, layer.dt_bias, layer.recurrent_state, slots, 3, False)
    with pytest.raises(ValueError, match="float32"):
        delta_rule_decode(mixed, b, a, layer.A, layer.dt_bias, layer.recurrent_state.bfloat16(), slots, 2, False)
    with pytest.raises(ValueError, match="dt_bias"):
        delta_rule_decode(mixed, b, a, layer.A, layer.dt_bias[:-1], layer.recurrent_state, slots, 2, False)
    wide = torch.zeros(3, 4, 512, 16)  # k_dim 512: a tile too large for registers
    channels = torch.zeros(2, 2 * 2 * 512 + 4 * 16)
    with pytest.raises(ValueError, match="up to 256"):
        delta_rule_decode(channels, b, a, layer.A, layer.dt_bias, wide, slots, 2, False)
    big = GatedDeltaNet(32, 2, 4, 512, 16, 4, 1e-6)
    big.use_kernels(torch.device("cuda"))
    assert big._decode_kernel is None  # the layer keeps its reference


def test_engine_runs_on_the_kernels_as_transformers(tiny_checkpoint) -> None:
    """The tiny Qwen3-Next through the engine with its Gated DeltaNet layers' decode and prefill on the kernels
    (`gated_delta_decode`, `delta_rule_prefill`) and output norms (`gated_rms_norm`) on the kernels, under the
    interpreter (only these layers swapped): greedy tokens identical to transformers', batched, each sequence
    decoding from the state its prefill left."""
    from edgemoe import LLM, SamplingParams

    folder, hf = tiny_checkpoint("qwen3next-dense", "per-expert")
    llm = LLM(str(folder), progress=False, dtype="float32")
    swapped = [m for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    for m in swapped:
        m.use_kernels(torch.device("cuda"))
        m.norm.use_kernels(torch.device("cuda"))
    assert len(swapped) == 3 and all(m._decode_kernel is gated_delta_decode for m in swapped)
    assert all(m.norm._kernel is gated_rms_norm for m in swapped)
    assert all(m._prefill_kernel is delta_rule_prefill for m in swapped)
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (5, 17, 9)]
    outs = llm.generate(batch, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
        assert out.token_ids == ref
