"""GGUF block formats (`edgemoe.quant`) against the `gguf` package: dequantization bitwise on fresh random
blocks (valid ones, and arbitrary bytes), quantization bitwise, sizes and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgemoe import quant
from edgemoe.quant import QUANT_TYPES, QUANTIZABLE, dequantize, quant_type, quantize, random_blocks, row_bytes

gguf = pytest.importorskip("gguf")  # a dependency, but absent from the GPU machines' image

NAMES = list(QUANT_TYPES)


def gguf_dequantize(raw: torch.Tensor, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):  # arbitrary bytes: NaN and inf scales
        return gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name])


@pytest.mark.parametrize("name", NAMES)
def test_types_are_ggml_sizes(name: str) -> None:
    q = quant_type(name)
    assert q is QUANT_TYPES[name] is quant_type(gguf.GGMLQuantizationType[name]) is quant_type(q)
    assert q is quant_type(int(gguf.GGMLQuantizationType[name])) is quant_type(name.lower())
    assert (q.block_weights, q.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert gguf.GGMLQuantizationType(q.ggml_type).name == name


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_valid_blocks_bitwise_as_gguf(name: str) -> None:
    g = torch.Generator().manual_seed(NAMES.index(name))
    raw = random_blocks((3, 5, 512), name, g, std=0.05)
    assert raw.dtype == torch.uint8 and raw.shape == (3, 5, row_bytes(name, 512)) and raw.any()
    w = dequantize(raw, name, 512)
    assert w.dtype == torch.float32 and w.shape == (3, 5, 512)
    assert torch.isfinite(w).all() and (w != 0).float().mean() > 0.8  # valid, and not mostly zeros
    assert torch.equal(w, torch.from_numpy(gguf_dequantize(raw, name)))


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_arbitrary_bytes_bitwise_as_gguf(name: str) -> None:
    """Every bit of every field random (scales of any value, NaN and inf halves included): the bit layouts."""
    q = quant_type(name)
    g = torch.Generator().manual_seed(100 + NAMES.index(name))
    raw = torch.randint(0, 256, (7, row_bytes(q, 4 * q.block_weights)), generator=g, dtype=torch.uint8)
    w = dequantize(raw, q, 4 * q.block_weights)
    np.testing.assert_array_equal(w.numpy(), gguf_dequantize(raw, name))  # NaNs in the same places count equal


def test_mxfp4_every_exponent_bitwise_as_gguf() -> None:
    """All 256 E8M0 scales, subnormal (e < 2) and overflowing ones included, with every nibble."""
    e = torch.arange(256, dtype=torch.uint8)[:, None]
    nibbles = torch.arange(16, dtype=torch.uint8)
    raw = torch.cat([e, (nibbles | (nibbles.flip(0) << 4)).expand(256, 16)], dim=1)  # [256, 17]
    np.testing.assert_array_equal(dequantize(raw, "MXFP4", 32).numpy(), gguf_dequantize(raw, "MXFP4"))


def test_dequantize_strided_views() -> None:
    """Banks as views into a joined row per expert (what the expert pools hold): same values as contiguous."""
    g = torch.Generator().manual_seed(7)
    a, b = random_blocks((4, 6, 256), "Q4_K", g), random_blocks((4, 8, 512), "Q6_K", g)
    joined = torch.cat([a.flatten(1), b.flatten(1)], dim=1)  # [4, 6 * 144 + 8 * 420]
    va = joined[:, : a[0].numel()].view(4, 6, 144)
    vb = joined[:, a[0].numel() :].view(4, 8, 420)
    assert not va.is_contiguous() and not vb.is_contiguous()
    assert torch.equal(dequantize(va, "Q4_K", 256), dequantize(a, "Q4_K", 256))
    assert torch.equal(dequantize(vb[1:3], "Q6_K", 512), dequantize(b[1:3], "Q6_K", 512))


@pytest.mark.parametrize("q", QUANTIZABLE, ids=[q.name for q in QUANTIZABLE])
def test_quantize_bitwise_as_gguf(q: quant.QuantType) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 5, 128, generator=g) * 0.05
    w[0, 0] = 0  # an all-zero row (zero scale)
    raw = quantize(w.to(torch.bfloat16), q)  # any float dtype, quantized from its float32 values
    assert raw.dtype == torch.uint8 and raw.shape == (3, 5, row_bytes(q, 128))
    expected = gguf.quants.quantize(w.to(torch.bfloat16).float().numpy(), q.ggml_type)
    assert torch.equal(raw, torch.from_numpy(expected))
    back = dequantize(raw, q, 128)
    # measured 0.005, 0.087, 0.116, 0.078, 0.042, 0.038
    bound = {"Q8_0": 0.01, "Q4_0": 0.12, "MXFP4": 0.15, "Q4_1": 0.11, "Q5_0": 0.06, "Q5_1": 0.055}[q.name]
    assert ((back - w).norm() / w.norm()).item() < bound


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_quantize_k_types_is_not_implemented(name: str) -> None:
    with pytest.raises(NotImplementedError):
        quantize(torch.zeros(2, 256), name)


def test_row_bytes_and_errors() -> None:
    assert row_bytes("Q4_K", 2048) == 8 * 144 and row_bytes("Q6_K", 768) == 3 * 210
    assert row_bytes("Q8_0", 2048) == 64 * 34 and row_bytes("Q4_0", 64) == 36 and row_bytes("MXFP4", 32) == 17
    for name, n in [("Q4_K", 1408), ("Q8_0", 48), ("Q6_K", 0), ("Q5_K", -256)]:
        with pytest.raises(ValueError, match="multiple of"):
            row_bytes(name, n)
    with pytest.raises(ValueError, match="unsupported"):
        row_bytes("Q2_K", 256)
    with pytest.raises(ValueError, match="unsupported"):
        quant_type(gguf.GGMLQuantizationType.IQ4_XS)
    with pytest.raises(ValueError, match="unsupported"):
        quant_type(10)  # Q2_K
    with pytest.raises(ValueError, match="expected uint8"):
        dequantize(torch.zeros(2, 143, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="expected uint8"):
        dequantize(torch.zeros(2, 144, dtype=torch.int8), "Q4_K", 256)


@pytest.mark.parametrize("std", [0.002, 0.02, 1.0])
def test_random_blocks_scale_and_determinism(std: float) -> None:
    for q in QUANT_TYPES.values():
        raw = random_blocks((64, 512), q, torch.Generator().manual_seed(5), std=std)
        assert torch.equal(raw, random_blocks((64, 512), q, torch.Generator().manual_seed(5), std=std))
        w = dequantize(raw, q, 512)
        assert torch.isfinite(w).all()
        assert 0.5 < w.std().item() / std < 2, q.name  # measured 0.93-1.5
        assert abs(w.mean().item()) < 0.2 * std, q.name
