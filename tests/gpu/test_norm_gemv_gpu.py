"""The residual add and RMSNorm fused into decode's qkv GEMV (`edgemoe.kernels.dense_gemv.norm_gemv`) compiled on
CUDA, at real geometries in bf16 and float32, against the two launches it replaces: h bitwise `add_rms_norm`'s, y
bitwise `gemv` of `add_rms_norm`'s normalised row at the same warps. No host synchronisation once compiled; CUDA-graph
replays with new inputs equal eager runs bitwise; in the engine, decode without PDL runs it in every layer after the
first, with greedy tokens equal to the separate norm's (float32), and decode with PDL does not."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.cuda_graphs import capture_graph
from tests.gpu.sync_free import host_sync_forbidden

EPS = 1e-6
# hidden -> q + k + v rows, and whether the family has a qkv bias
GEOMETRIES = {
    "qwen3-30b-a3b": (2048, 5120, False),
    "qwen1.5-moe-a2.7b": (2048, 6144, True),
    "mixtral-8x7b": (4096, 6144, False),
}


def inputs(hidden: int, n: int, bias: bool, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = 0.5 * torch.randn(1, hidden, generator=g, device="cuda")
    residual = 3 * torch.randn(1, hidden, generator=g, device="cuda")
    norm_weight = 1 + 0.5 * torch.randn(hidden, generator=g, device="cuda")
    weight = torch.randn(n, hidden, generator=g, device="cuda") / hidden**0.5
    b = torch.randn(n, generator=g, device="cuda") if bias else None
    return tuple(None if t is None else t.to(dtype) for t in (x, residual, norm_weight, weight, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_matches_add_rms_norm_then_gemv(name: str, dtype: torch.dtype) -> None:
    from edgemoe.kernels.dense_gemv import gemv, norm_gemv, norm_warps
    from edgemoe.kernels.norm_rope import add_rms_norm

    hidden, n, bias = GEOMETRIES[name]
    x, residual, norm_weight, weight, b = inputs(hidden, n, bias, dtype, seed=hidden + n)
    y, h = norm_gemv(x, residual, norm_weight, EPS, weight, b)
    xn, ref_h = add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(h, ref_h)
    assert torch.equal(y, gemv(xn, weight, b, warps=norm_warps(hidden)))


def test_no_host_sync_and_graph_replays() -> None:
    from edgemoe.kernels.dense_gemv import norm_gemv

    hidden, n, bias = GEOMETRIES["qwen1.5-moe-a2.7b"]
    x, residual, norm_weight, weight, b = inputs(hidden, n, bias, torch.bfloat16, seed=1)
    norm_gemv(x, residual, norm_weight, EPS, weight, b)  # compiles (may sync)
    with torch.cuda.device(x.device), host_sync_forbidden():
        norm_gemv(x, residual, norm_weight, EPS, weight, b)
    graph, outs = capture_graph(lambda: norm_gemv(x, residual, norm_weight, EPS, weight, b))
    for seed in (2, 3):
        new = inputs(hidden, n, bias, torch.bfloat16, seed=seed)
        x.copy_(new[0])
        residual.copy_(new[1])
        for t in outs:
            t.fill_(-1)
        graph.replay()
        eager = norm_gemv(x, residual, norm_weight, EPS, weight, b)
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
def test_decode_runs_it_without_pdl_with_the_separate_norms_tokens(monkeypatch: pytest.MonkeyPatch, pdl: bool) -> None:
    """The demo model in float32, graphs off so that every decode step runs the layers. Without PDL (forced off
    here): one `norm_gemv` per layer after the first, and greedy tokens equal to those of the separate norm (the
    fusion switched off). With PDL (Hopper), where it measured slower, decode keeps the separate norm."""
    import edgemoe.kernels.dense_gemv as dense_gemv
    import edgemoe.kernels.pdl as pdl_module
    from edgemoe.layers.attention import Attention

    if pdl and not pdl_module.use_pdl(torch.device("cuda")):
        pytest.skip("this GPU has no PDL")
    if not pdl:
        monkeypatch.setattr(pdl_module, "use_pdl", lambda device: False)
    calls = []
    fused = dense_gemv.norm_gemv
    monkeypatch.setattr(dense_gemv, "norm_gemv", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(device="cuda", dtype="float32", progress=False, cuda_graphs=False, warmup=False)  # its 1-token prompt
    layers = llm.engine.runner.model.config.num_layers
    got = llm.generate(["ROMEO.\n"], greedy)[0].token_ids
    assert len(calls) == (0 if pdl else (layers - 1) * 23)  # 23 decode steps after the prefill's token
    monkeypatch.setattr(Attention, "fuses_norm", lambda *a: False)
    calls.clear()
    assert llm.generate(["ROMEO.\n"], greedy)[0].token_ids == got and not calls
