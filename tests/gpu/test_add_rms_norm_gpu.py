"""The residual add fused into RMSNorm (`add_rms_norm`, `edgemoe.kernels.norm_rope`) compiled on CUDA: against its
torch reference `RMSNorm.reference(x, residual)` and against the unfused pair it replaces (torch's add, then
`rms_norm`) at real shapes in float32 and bf16, through the layer's CUDA dispatch, without host synchronisation,
replayed from a CUDA graph with new inputs; and the whole decoder on CUDA against its textbook form.

The sum must be bitwise torch's; the norm bitwise `rms_norm` of it (same arithmetic, same warps, so the same order of
the sum of squares), and against torch within a rare flipped rounding of x * rsqrt (bf16) or 1e-6 (float32)."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.layers.norm import RMSNorm
from tests.gpu.sync_free import host_sync_forbidden
from tests.gpu.test_norm_rope_gpu import assert_close_to_reference, gen, make_norm, randn
from tests.kernels.test_add_rms_norm import check_decoder_against_textbook

EPS = 1e-6


def check(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    from edgemoe.kernels.norm_rope import add_rms_norm, rms_norm

    before = x.clone(), residual.clone()
    out, h = add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs only read
    assert h.dtype == torch.promote_types(x.dtype, residual.dtype) and torch.equal(h, x + residual)
    assert torch.equal(out, rms_norm(x + residual, norm.weight, EPS))  # what the decoder launched before
    ref_out, ref_h = norm.reference(x, residual)
    assert torch.equal(h, ref_h)
    assert_close_to_reference(out, ref_out, h.dtype)
    layer_out, layer_h = norm(x, residual)  # the layer dispatches to the kernel on CUDA
    assert torch.equal(layer_out, out) and torch.equal(layer_h, h)
    return out, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_matches_reference_and_the_unfused_pair(hidden: int, tokens: int, dtype: torch.dtype) -> None:
    g = gen(tokens + hidden)
    norm = make_norm(hidden, dtype, g)
    check(randn(tokens, hidden, g=g, dtype=dtype), randn(tokens, hidden, g=g, dtype=dtype, scale=4.0), norm)


def test_strided_views_and_mixed_dtypes() -> None:
    g = gen(5)
    norm = make_norm(2048, torch.bfloat16, g)
    wide = randn(6, 3 * 2048, g=g, dtype=torch.bfloat16)
    check(wide[:, 2048:4096], randn(6, 2048, g=g, dtype=torch.bfloat16), norm)  # a view of a fused projection
    check(randn(6, 2048, g=g, dtype=torch.bfloat16), randn(6, 2048, g=g, dtype=torch.float32), norm)  # fp32 stream


def test_long_prefill_row_offsets() -> None:
    # rows * hidden past 2^31: the int64 row offsets (4.3 GB of bf16 per tensor)
    tokens, hidden = 2**31 // 4096 + 8, 4096
    g = gen(9)
    norm = make_norm(hidden, torch.bfloat16, g)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
    residual = torch.empty_like(x).normal_(generator=g)
    out, h = norm(x, residual)
    tail = slice(tokens - 16, tokens)
    assert torch.equal(h[tail], x[tail] + residual[tail])
    assert torch.equal(out[tail], norm(x[tail] + residual[tail]))


def test_no_host_sync_once_compiled() -> None:
    from edgemoe.kernels.norm_rope import add_rms_norm

    g = gen(0)
    x, r, w = (randn(*s, g=g, dtype=torch.bfloat16) for s in ((1, 2048), (1, 2048), (2048,)))
    add_rms_norm(x, r, w, EPS)  # compiles (may sync)
    with torch.cuda.device(x.device), host_sync_forbidden():
        add_rms_norm(x, r, w, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype) -> None:
    """Two layers' residual stream (input norm of the first alone, then each add fused into the next norm, a linear
    map standing in for attention and MLP) captured once over static buffers and replayed with new embeddings."""
    tokens, hidden = 4, 2048
    g = gen(1)
    norms = [make_norm(hidden, dtype, g) for _ in range(5)]
    blocks = [torch.nn.Linear(hidden, hidden, bias=False).to("cuda", dtype).requires_grad_(False) for _ in range(4)]
    x = randn(tokens, hidden, g=g, dtype=dtype)

    def stream() -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norms[0](x), x
        for norm, block in zip(norms[1:], blocks):
            h, residual = norm(block(h), residual)
        return h, residual

    def textbook() -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for norm, block in zip(norms, blocks):
            h = h + block(norm(h))
        return norms[-1](h), h

    graph, outs = capture_graph(stream)
    for seed in range(2, 5):
        x.copy_(randn(tokens, hidden, g=gen(seed), dtype=dtype))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for o, e, t in zip(outs, stream(), textbook()):
            assert torch.equal(o, e)  # every element rewritten, deterministic
            assert torch.equal(o, t)  # the same numbers as the separate adds and norms


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_is_bitwise_the_textbook_form(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager prefill and decode steps of the demo model on CUDA: the fused norms give the textbook form's hidden
    states bit for bit. Without the start-up warm-up: its dummy prompt keeps all its K/V in the one pad block, so its
    attention reads whichever write landed there last (its output is thrown away), not a forward to compare."""
    check_decoder_against_textbook(monkeypatch, device="cuda", dtype=dtype, cuda_graphs=False, warmup=False)
