"""Programmatic dependent launch (`edgemoe.kernels.pdl`) on CUDA: on compute capability 9.0+ our kernels launch with
it, and a chain of dependent kernels (add + RMSNorm -> dense GEMV -> add + RMSNorm -> ...), each reading what the one
before it wrote at once, gives bit for bit what ordinary launches give, eager and replayed from a CUDA graph (a
kernel reading before its predecessor finished would read stale or half-written rows)."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels import pdl


def chain(x: torch.Tensor, weights: list[torch.Tensor], norm_w: torch.Tensor) -> torch.Tensor:
    from edgemoe.kernels.dense_gemv import gemv
    from edgemoe.kernels.norm_rope import add_rms_norm

    residual = x
    for w in weights:  # [H, H]: every link's output is the next one's input
        normed, residual = add_rms_norm(x, residual, norm_w, 1e-6)
        x = gemv(normed, w)
    return x + residual


def test_pdl_on_hopper_and_newer() -> None:
    dev = torch.device("cuda")
    assert pdl.use_pdl(dev) == (torch.cuda.get_device_capability()[0] >= 9)
    assert not pdl.use_pdl(torch.device("cpu"))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90+"
)
def test_dependent_chain_equals_ordinary_launches(monkeypatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    H = 2048
    weights = [torch.randn(H, H, device="cuda", generator=gen).bfloat16() / H**0.5 for _ in range(16)]
    norm_w = (1 + 0.1 * torch.randn(H, device="cuda", generator=gen)).bfloat16()
    inputs = [torch.randn(1, H, device="cuda", generator=gen).bfloat16() for _ in range(3)]

    monkeypatch.setattr(pdl, "use_pdl", lambda device: False)
    expected = [chain(x, weights, norm_w) for x in inputs]
    monkeypatch.undo()
    assert pdl.launch_args(torch.device("cuda"))["launch_pdl"]

    for x, want in zip(inputs, expected, strict=True):  # eager, with PDL
        assert torch.equal(chain(x, weights, norm_w), want)
    static = inputs[0].clone()
    graph, out = capture_graph(lambda: chain(static, weights, norm_w))
    for _ in range(20):  # replays, new inputs each time
        for x, want in zip(inputs, expected, strict=True):
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, want)
