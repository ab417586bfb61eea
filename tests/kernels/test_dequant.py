"""GGUF blocks dequantized on the device (`edgemoe.kernels.dequant`), and what is built on them: bitwise the plain
torch `dequantize` (itself bitwise gguf's numpy code) on fresh random blocks of every format, gathered rows and ragged
row ends; quantized prefill in waves (`quant_pair_outputs`) against gguf's dequantization with a float64 matmul and
bitwise the same whatever the waves and the rows holding the experts. Without CUDA under Triton's interpreter
(tests/conftest.py). Tolerance of the float32 prefill: the bf16 grouped GEMM's float32 path (IEEE dots) against float64
over sums of 256 products, 1e-5 relative."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from edgemoe.kernels.dequant import dequantize_rows, dequantize_weight, quant_pair_outputs  # noqa: E402
from edgemoe.quant import QUANT_TYPES, dequantize, quant_type, random_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAIRS = [(name, name) for name in QUANT_TYPES] + [("Q4_K", "Q6_K")]
IDS = [a if a == b else f"{a}+{b}" for a, b in PAIRS]


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_rows_dequantize_bitwise_as_the_reference(name: str) -> None:
    """Gathered rows of a bank (not in order, one twice), 20 rows (not a whole number of 16-row tiles), rows of two
    and a half program steps for the 32-weight formats (224 + 96 weights)."""
    n = 512 if quant_type(name).block_weights == 256 else 320
    g = torch.Generator().manual_seed(hash(name) % 1000)
    bank = random_blocks((5, 20, n), name, g, std=0.1).to(DEVICE)
    idx = torch.tensor([3, 0, 4, 3], device=DEVICE)
    out = dequantize_rows(bank, idx, name, n, dtype=torch.float32)
    assert torch.equal(out.cpu(), dequantize(bank[idx].cpu(), name, n))
    dense = dequantize_weight(bank[1], name, n, torch.float32)
    assert torch.equal(dense.cpu(), dequantize(bank[1].cpu(), name, n))


def banks(q13: str, q2: str, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(w13, w2, H, I): one super-block a row where a K format is used, else H = 128, I = 96."""
    k = 256 in (quant_type(q13).block_weights, quant_type(q2).block_weights)
    H, inter = (256, 256) if k else (128, 96)
    g = torch.Generator().manual_seed(seed)
    w13 = random_blocks((experts, 2 * inter, H), q13, g, std=H**-0.5)
    w2 = random_blocks((experts, H, inter), q2, g, std=inter**-0.5)
    return w13, w2, H, inter


def routing(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, top_k, generator=g) + 0.1


@pytest.mark.parametrize(("q13", "q2"), PAIRS, ids=IDS)
def test_prefill_matches_gguf(q13: str, q2: str) -> None:
    E, K, T = 4, 2, 30
    w13, w2, H, inter = banks(q13, q2, E, seed=11)
    x, ids, wts = routing(T, H, E, K, seed=12)
    d13, d2 = (gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType[q]) for b, q in ((w13, q13), (w2, q2)))
    ref = np.zeros((T, H))
    for t, k in np.ndindex(*ids.shape):
        e = int(ids[t, k])
        gate, up = np.split(d13[e].astype(np.float64) @ x[t].double().numpy(), 2)
        ref[t] += float(wts[t, k]) * (d2[e].astype(np.float64) @ (gate / (1 + np.exp(-gate)) * up))
    y = quant_pair_outputs(x.to(DEVICE), ids.flatten().to(DEVICE), wts.flatten().to(DEVICE), w13.to(DEVICE),
                           w2.to(DEVICE), q13, q2, wave=3)  # fmt: skip
    out = y.view(T, K, H).sum(dim=1).double().cpu()
    assert float((out - torch.from_numpy(ref)).norm() / torch.from_numpy(ref).norm()) < 1e-5


def test_waves_and_rows_do_not_change_a_bit() -> None:
    """One wave, waves of one expert, and the experts at other rows of a larger pool with some pairs skipped (rows
    -1, their outputs untouched): bitwise the same pair outputs."""
    q13, q2, E, K = "Q4_K", "Q6_K", 4, 2
    w13, w2, H, inter = banks(q13, q2, E, seed=21)
    x, ids, wts = routing(40, H, E, K, seed=22)
    x, ids, wts, w13, w2 = (t.to(DEVICE) for t in (x, ids, wts, w13, w2))
    flat = ids.flatten()
    whole = quant_pair_outputs(x, flat, wts.flatten(), w13, w2, q13, q2, wave=E)
    assert torch.equal(quant_pair_outputs(x, flat, wts.flatten(), w13, w2, q13, q2, wave=1), whole)
    slot_of = torch.tensor([5, 1, 6, 2], device=DEVICE)
    pool13 = torch.zeros(7, *w13.shape[1:], dtype=torch.uint8, device=DEVICE)
    pool2 = torch.zeros(7, *w2.shape[1:], dtype=torch.uint8, device=DEVICE)
    pool13[slot_of], pool2[slot_of] = w13, w2
    y = torch.full_like(whole, float("nan"))
    for wave in ([0, 3], [1, 2]):
        in_wave = torch.isin(flat, torch.tensor(wave, device=DEVICE))
        quant_pair_outputs(x, torch.where(in_wave, slot_of[flat], -1), wts.flatten(), pool13, pool2, q13, q2, out=y)
        if wave == [0, 3]:
            assert torch.isnan(y[~in_wave]).all()
    assert torch.equal(y, whole)
