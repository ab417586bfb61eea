"""The dense decode GEMV (`edgemoe.kernels.dense_gemv.gemv`) compiled on CUDA: the real projection shapes in bf16
against a float64 `F.linear` within the fp32-accumulation bound of tests/kernels/test_dense_gemv.py, `DecodeLinear`'s
dispatch (one row: the GEMV, near cuBLAS; more rows: cuBLAS itself), no host synchronisation once compiled, and
replays of a CUDA graph with new inputs equal to eager runs bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.context import ForwardContext, set_context
from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.layers.linear import DecodeLinear
from tests.gpu.sync_free import host_sync_forbidden
from tests.kernels.test_dense_gemv import assert_within_bound, error_bound, inputs

# name -> (out, in, bias): benchmarks/dense_gemv.py's shapes (qwen1.5's qkv has a bias)
SHAPES = {
    "qwen3-30b-a3b qkv": (5120, 2048, False),
    "qwen3-30b-a3b o": (2048, 4096, False),
    "qwen1.5-moe-a2.7b qkv": (6144, 2048, True),
    "qwen1.5-moe-a2.7b o": (2048, 2048, False),
    "qwen1.5-moe-a2.7b shared gate_up": (11264, 2048, False),
    "qwen1.5-moe-a2.7b shared down": (2048, 5632, False),
}


@pytest.fixture
def cublas_fp32_reduction():
    """cuBLAS may reduce bf16 split-K partials in bf16; held to the same fp32-accumulation bound it must not."""
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("name", list(SHAPES))
def test_real_shapes_bf16(name: str, tokens: int) -> None:
    from edgemoe.kernels.dense_gemv import gemv

    n, k, bias = SHAPES[name]
    x, w, b = inputs(tokens, n, k, torch.bfloat16, bias, seed=tokens, device="cuda")
    assert_within_bound(gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_linear_dispatch(name: str, cublas_fp32_reduction) -> None:
    from edgemoe.kernels.dense_gemv import gemv

    n, k, bias = SHAPES[name]
    x, w, b = inputs(4, n, k, torch.bfloat16, bias, seed=7, device="cuda")
    layer = DecodeLinear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    layer.use_kernels(torch.device("cuda"))  # as the loader chooses for a CUDA device
    layer.weight.copy_(w)
    if bias:
        layer.bias.copy_(b)
    one = layer(x[:1])
    assert torch.equal(one, gemv(x[:1], w, b))  # one row: the GEMV in any step
    for prefill, expected in ((False, gemv(x, w, b)), (True, F.linear(x, w, b))):  # more: the GEMV in decode only
        set_context(ForwardContext(prefill, None, None, None))
        try:
            assert torch.equal(layer(x), expected)
        finally:
            set_context(None)
    bound = error_bound(x[:1], w, b, torch.bfloat16)[1]  # each of the two within it of the exact result
    assert ((one.double() - F.linear(x[:1], w, b).double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("name", [*SHAPES, "qwen3-30b-a3b lm_head"])
def test_a_row_does_not_depend_on_the_batch(name: str) -> None:
    """Batch invariance at the engine's shapes: each token's row bitwise the same alone and among 2-9 tokens (groups
    of 2 and 4 and several groups: `token_group`)."""
    from edgemoe.kernels.dense_gemv import gemv

    n, k, bias = SHAPES.get(name, (151936, 2048, False))
    x, w, b = inputs(9, n, k, torch.bfloat16, bias, seed=11, device="cuda")
    alone = torch.cat([gemv(x[i : i + 1], w, b) for i in range(9)])
    for tokens in range(2, 10):
        assert torch.equal(gemv(x[:tokens], w, b), alone[:tokens]), tokens


def test_no_host_sync_once_compiled() -> None:
    from edgemoe.kernels.dense_gemv import gemv

    x, w, b = inputs(1, 2048, 4096, torch.bfloat16, True, seed=3, device="cuda")
    gemv(x, w, b)  # compiles (may sync)
    with torch.cuda.device(x.device), host_sync_forbidden():
        gemv(x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 4])
def test_cuda_graph_replays_new_inputs(tokens: int, dtype: torch.dtype) -> None:
    from edgemoe.kernels.dense_gemv import gemv

    x, w, b = inputs(tokens, 6144, 2048, dtype, True, seed=4, device="cuda")
    graph, y = capture_graph(lambda: gemv(x, w, b))
    for seed in range(5, 8):
        x.copy_(inputs(tokens, 6144, 2048, dtype, False, seed=seed, device="cuda")[0])
        y.fill_(float("nan"))
        graph.replay()
        assert torch.equal(y, gemv(x, w, b))  # every element rewritten, deterministic
    assert_within_bound(y, x, w, b)
