"""The Gated DeltaNet prefill kernel (`edgemoe.kernels.gated_delta_prefill`, Triton's interpreter on CPU) against the
layer's plain-torch prefill (`chunked_delta_rule` per sequence from its slot's state) and, as a second reference,
the decode recurrence token by token (`recurrent_step`), on fresh random inputs and states: fp32 and bf16, grouped
and tiled value heads, head dims off powers of two, sequences below, at and above the 64-token chunk (ragged tails)
in one batch, states in a StateCache pool (strided slot views beside another layer's), shuffled and int32 slots.

Tolerances. The kernel sums in other orders than torch (its own products, the chunk's inverse by doubling where
torch solves by substitution) and its exp and rsqrt may differ by an ulp: fp32 outputs and states within 1e-5
relative of the chunked reference, within 2e-5 of the token-by-token one (which rounds each step apart). A bf16
output rounds those fp32 values once, so it lands on the reference's bf16 value or, rarely, its neighbour."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from edgemoe.context import ForwardContext
from edgemoe.kernels import gated_delta_prefill
from edgemoe.kernels.gated_delta_prefill import delta_rule_prefill
from edgemoe.layers import linear_attention
from edgemoe.layers.linear_attention import GatedDeltaNet, chunked_delta_rule, recurrent_step
from tests.kernels import interpreter_only
from tests.kernels.test_gated_delta import (
    FP32,
    SLOTS,
    assert_half_close,
    make_layers,
    randomize,
    reference_then_kernels,
    states,
)

pytestmark = interpreter_only

RECURRENT = dict(rtol=2e-5, atol=2e-6)


def prefill_inputs(layer: GatedDeltaNet, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Convolved channels (SiLU's range), beta (the model's dtype) and the log decay g (fp32, <= 0) of a prefill;
    the value heads' decay rates spread from 1e-3 to 0.5 a token (a 64-token chunk keeps 94% of the state, or none)."""
    device = layer.conv1d.weight.device
    channels = torch.nn.functional.silu(2 * torch.randn(tokens, layer.channels, device=device)).to(dtype)
    beta = torch.sigmoid(2 * torch.randn(tokens, layer.v_heads, device=device)).to(dtype)
    rates = torch.logspace(-3, math.log10(0.5), layer.v_heads, device=device)
    g = -2 * rates * torch.rand(tokens, layer.v_heads, device=device)
    return channels, beta, g


def cu_seqlens(lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def chunked(layer: GatedDeltaNet, channels, beta, g, lens: list[int], slots, pool: torch.Tensor):
    """The reference: `chunked_delta_rule` per sequence from its slot -> (out, the pool after)."""
    pool, outs = pool.clone(), []
    q, k, v = layer._heads(channels)
    for (a, b), slot in zip(itertools.pairwise(cu_seqlens(lens).tolist()), slots.tolist()):
        o, pool[slot] = chunked_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pool[slot])
        outs.append(o)
    return torch.cat(outs), pool


def recurrent(layer: GatedDeltaNet, channels, beta, g, lens: list[int], slots, pool: torch.Tensor):
    """The second reference: one `recurrent_step` a token -> (out, the pool after)."""
    pool, outs = pool.clone(), []
    q, k, v = layer._heads(channels)
    for (a, b), slot in zip(itertools.pairwise(cu_seqlens(lens).tolist()), slots.tolist()):
        for t in range(a, b):
            o, state = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                      pool[slot : slot + 1])  # fmt: skip
            pool[slot] = state[0]
            outs.append(o)
    return torch.cat(outs), pool


def run_kernel(layer: GatedDeltaNet, channels, beta, g, lens: list[int], slots) -> torch.Tensor:
    cu = cu_seqlens(lens, channels.device)
    return delta_rule_prefill(channels, beta, g, layer.recurrent_state, slots, cu, max(lens), layer.k_heads,
                              layer.tiled)  # fmt: skip


# (k_heads, v_heads, k_dim, v_dim); (2, 4, 16, 8) is the tiny hybrid checkpoints' (tests/conftest.py)
GEOMETRIES = [(2, 4, 16, 8), (2, 4, 16, 32), (1, 2, 48, 40)]
LENS = [130, 5, 64, 63]  # 2 chunks + a ragged tail; below, at and just under the chunk


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda s: "k{}-v{}-dk{}-dv{}".format(*s))
def test_float32_matches_references(geometry, tiled: bool) -> None:
    layers, cache = make_layers(geometry, torch.float32, tiled, seed=sum(geometry) + tiled)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, sum(LENS), torch.float32)
    slots = torch.tensor([5, 0, 7, 2], dtype=torch.int32)  # shuffled, int32
    before, start = cache.pool.clone(), layer.recurrent_state.clone()
    out = run_kernel(layer, channels, beta, g, LENS, slots)
    ref, ref_state = chunked(layer, channels, beta, g, LENS, slots, start)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(layer.recurrent_state, ref_state, **FP32)
    rec, rec_state = recurrent(layer, channels, beta, g, LENS, slots, start)
    torch.testing.assert_close(out, rec, **RECURRENT)
    torch.testing.assert_close(layer.recurrent_state, rec_state, **RECURRENT)
    # only the batch's slots of this layer's recurrent state changed
    other = torch.ones(SLOTS + 1, dtype=torch.bool)  # (+ the pad slot)
    other[slots.long()] = False
    assert torch.equal(cache.pool[other], before[other])
    assert not torch.equal(layer.recurrent_state[slots.long()], start[slots.long()])
    assert torch.equal(layer.conv_state, states(layer, cache, before)[0])
    for view, was in zip(states(layers[1], cache, cache.pool), states(layers[1], cache, before)):
        assert torch.equal(view, was)


@pytest.mark.parametrize("tokens", [1, 64, 65])
def test_single_sequences_around_the_chunk(tokens: int) -> None:
    layers, _ = make_layers((2, 2, 16, 16), torch.float32, tiled=False, seed=tokens)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, tokens, torch.float32)
    slots = torch.tensor([3])
    start = layer.recurrent_state.clone()
    out = run_kernel(layer, channels, beta, g, [tokens], slots)
    ref, ref_state = chunked(layer, channels, beta, g, [tokens], slots, start)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(layer.recurrent_state, ref_state, **FP32)


def test_full_head() -> None:
    """Qwen3-Next's head (128 x 128, four blocks of value dims), a few tokens."""
    layers, _ = make_layers((1, 1, 128, 128), torch.float32, tiled=False, seed=9, slots=2)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, 20, torch.float32)
    slots = torch.tensor([1])
    start = layer.recurrent_state.clone()
    out = run_kernel(layer, channels, beta, g, [20], slots)
    ref, ref_state = chunked(layer, channels, beta, g, [20], slots, start)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(layer.recurrent_state, ref_state, **FP32)


def test_nearly_parallel_keys() -> None:
    """The hard case for the chunk's inverse: keys nearly parallel, beta near 1 and little decay, so that A is full
    of entries near 1 and its powers grow like binomials (an inverse summed as the series (I - A)(I + A^2)(I + A^4)..
    passes every other test here and fails this one). Within fp32's tolerance of the recurrence, its states float64."""
    layers, _ = make_layers((1, 1, 32, 32), torch.float32, tiled=False, seed=13, slots=2)
    layer = layers[0]
    channels, _, _ = prefill_inputs(layer, 128, torch.float32)
    channels[:, 32:64] = torch.randn(32) + 0.01 * torch.randn(128, 32)  # the k head
    beta, g = 0.9 + 0.1 * torch.rand(128, 1), -0.01 * torch.rand(128, 1)
    start = layer.recurrent_state.clone()
    out = run_kernel(layer, channels, beta, g, [128], torch.tensor([1]))
    truth, state = recurrent(layer, channels, beta, g, [128], torch.tensor([1]), start.double())  # float64 states
    torch.testing.assert_close(out, truth.float(), **FP32)
    torch.testing.assert_close(layer.recurrent_state, state.float(), **FP32)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_bfloat16_matches_reference(tiled: bool) -> None:
    """bf16 channels and beta, fp32 g and states: the states within fp32's tolerance, the outputs rounded once."""
    layers, _ = make_layers((2, 4, 32, 16), torch.bfloat16, tiled, seed=21 + tiled)
    layer = layers[0]
    lens = [100, 7]
    channels, beta, g = prefill_inputs(layer, sum(lens), torch.bfloat16)
    slots = torch.tensor([6, 1])
    start = layer.recurrent_state.clone()
    out = run_kernel(layer, channels, beta, g, lens, slots)
    ref, ref_state = chunked(layer, channels, beta, g, lens, slots, start)
    torch.testing.assert_close(layer.recurrent_state, ref_state, **FP32)
    assert_half_close(out, ref)


def test_layer_picks_the_kernel_for_prefill() -> None:
    """`use_kernels` swaps prefill's delta rule for the kernel; forward under a prefill context of three sequences
    then matches the reference layer: outputs and both states at the slots."""
    layers, cache = make_layers((2, 4, 16, 16), torch.float32, tiled=True, seed=3)
    layer = layers[0]
    randomize(layer)
    lens = [70, 3, 12]
    x, slots = torch.randn(sum(lens), 32), torch.tensor([3, 6, 1])
    context = ForwardContext(True, torch.empty(0), torch.ones(3), torch.zeros(3, 1), query_lens=lens,
                             state_slots=slots)  # fmt: skip
    # use_kernels: what select_kernels calls on a CUDA device
    ref, ref_pool, out, pool = reference_then_kernels(layer, cache, x, context, lambda m: m.use_kernels("cuda"))
    assert layer._prefill_kernel is delta_rule_prefill
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(pool.view(torch.float32), ref_pool.view(torch.float32), **FP32)


def test_no_tokens_and_bad_arguments() -> None:
    assert gated_delta_prefill.L2_EPS == linear_attention.L2_EPS  # written twice: a kernel imports no layer
    assert gated_delta_prefill.CHUNK == linear_attention.CHUNK
    layers, _ = make_layers((2, 4, 16, 16), torch.float32, tiled=False, seed=5)
    layer = layers[0]
    channels, beta, g = prefill_inputs(layer, 6, torch.float32)
    state, before = layer.recurrent_state, layer.recurrent_state.clone()
    slots, cu = torch.tensor([0, 1]), cu_seqlens([4, 2])
    out = delta_rule_prefill(channels[:0], beta[:0], g[:0], state, slots[:0], cu[:1], 0, 2, False)
    assert out.shape == (0, 4, 16) and torch.equal(state, before)
    with pytest.raises(ValueError, match="q/k heads"):
        delta_rule_prefill(channels, beta, g, state, slots, cu, 4, 3, False)
    with pytest.raises(ValueError, match="float32"):
        delta_rule_prefill(channels, beta, g, state.bfloat16(), slots, cu, 4, 2, False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        delta_rule_prefill(channels, beta, g, state, slots, cu[:2], 4, 2, False)
    wide = torch.zeros(3, 4, 512, 16)  # k_dim 512: a tile too large for registers
    with pytest.raises(ValueError, match="up to 256"):
        delta_rule_prefill(torch.zeros(6, 2 * 2 * 512 + 4 * 16), beta, g, wide, slots, cu, 4, 2, False)
    big = GatedDeltaNet(32, 2, 4, 512, 16, 4, 1e-6)
    big.use_kernels(torch.device("cuda"))
    assert big._prefill_kernel is None  # the layer keeps its reference
