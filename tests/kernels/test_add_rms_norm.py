"""The residual add fused into RMSNorm (`add_rms_norm`, Triton's interpreter on CPU) against its torch reference
`RMSNorm.reference(x, residual)` and against `rms_norm` of torch's own sum, on fresh random inputs: hidden sizes
off powers of two, 3-D shapes, strided views, mixed dtypes, round-to-nearest-even ties in the add.

The sum must be bitwise torch's `x + residual`, and the norm bitwise `rms_norm` of it (same arithmetic); against the
torch reference the norm differs only by the order of the sum of squares, as `rms_norm` does (test_norm_rope.py).
The CPU layer path must be bitwise the separate add and norm it replaced (the decoder's results stay the same)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.kernels.norm_rope import add_rms_norm, rms_norm
from edgemoe.layers.norm import RMSNorm
from edgemoe.models.decoder import MoEForCausalLM
from tests.kernels import interpreter_only

pytestmark = interpreter_only

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_norm(dim: int, dtype: torch.dtype, eps: float = EPS) -> RMSNorm:
    norm = RMSNorm(dim, eps)
    norm.weight.data = (1 + 0.5 * torch.randn(dim)).to(dtype)  # around one, as trained norms are, but not ones
    return norm


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, x_dtype: torch.dtype) -> None:
    """Float32: the sum order only (1e-6). 16-bit: x * r may round to the neighbouring value (one ulp), which the
    weight then scales, so 2.5 ulps relative bound it; and such flips must be rare."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-6 if x_dtype == torch.float32 else 2.5 * torch.finfo(x_dtype).eps
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.0)
    if x_dtype != torch.float32:
        assert (out == ref).float().mean() >= 0.99


def check(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> None:
    before = x.clone(), residual.clone()
    out, h = add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs only read
    assert h.is_contiguous() and out.is_contiguous()
    ref_out, ref_h = norm.reference(x, residual)
    assert h.dtype == ref_h.dtype and torch.equal(h, ref_h)  # torch's add, bitwise
    assert torch.equal(out, rms_norm(ref_h, norm.weight, norm.eps))  # the unfused kernel on torch's sum, bitwise
    assert_close_to_reference(out, ref_out, h.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 96), (5, 200), (3, 256), (2, 1000)], ids=str)
def test_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    norm = make_norm(shape[-1], dtype)
    x, residual = (0.5 * torch.randn(*shape)).to(dtype), (3 * torch.randn(*shape)).to(dtype)
    check(x, residual, norm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_add_rounds_ties_to_even(dtype: torch.dtype) -> None:
    # exact sums half an ulp off a representable value: torch rounds them to the even neighbour, never truncates
    ulp = torch.finfo(dtype).eps  # at 1.0
    base = torch.tensor([1, 1 + ulp, 1 + 2 * ulp, 1 + 3 * ulp, -1 - ulp, -1 - 2 * ulp, -1 - 3 * ulp, 2 - ulp])
    x = base[:, None].expand(8, 16).to(dtype)  # [8, 16]
    residual = torch.full_like(x, ulp / 2)
    residual[:, 8:] = -ulp / 4  # and below half an ulp: towards x
    check(x, residual, make_norm(16, dtype))
    assert ((x.double() + residual.double()) != (x + residual).double()).all()  # every sum rounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_3d_and_strided_views(dtype: torch.dtype) -> None:
    norm = make_norm(96, dtype, eps=1e-5)
    wide = torch.randn(3, 4, 160).to(dtype)
    x = torch.randn(3, 4, 96).to(dtype)
    check(x, wide[:, :, 32:128], norm)  # residual rows that do not flatten
    check(wide[:, :, 10:106], x, norm)
    t = torch.randn(96, 5).to(dtype).t()  # [5, 96], last-dim stride 5
    check(t, torch.randn(5, 96).to(dtype), norm)
    rows = torch.randn(5, 2 * 96).to(dtype)[:, :96]  # row stride 192, unlike residual's 96
    check(rows, torch.randn(5, 96).to(dtype), norm)


@pytest.mark.parametrize(
    "x_dtype, r_dtype, w_dtype",
    [
        (torch.bfloat16, torch.float32, torch.bfloat16),  # a float32 residual stream: the sum in float32
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.bfloat16, torch.float32),  # float16 + bfloat16 promote to float32
        (torch.bfloat16, torch.bfloat16, torch.float32),  # the weight promotes the norm only
    ],
    ids=str,
)
def test_mixed_dtypes_promote_like_torch(x_dtype: torch.dtype, r_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    norm = make_norm(200, w_dtype)
    x, residual = torch.randn(4, 200).to(x_dtype), torch.randn(4, 200).to(r_dtype)
    check(x, residual, norm)
    out, h = add_rms_norm(x, residual, norm.weight, EPS)
    assert h.dtype == torch.promote_types(x_dtype, r_dtype)
    assert out.dtype == torch.promote_types(h.dtype, w_dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_cpu_path_is_the_separate_add_and_norm(dtype: torch.dtype) -> None:
    """On CPU `norm(x, residual)` is bitwise what the decoder computed before: h = residual + x, then norm(h)."""
    norm = make_norm(200, dtype)
    x, residual = torch.randn(7, 200).to(dtype), (4 * torch.randn(7, 200)).to(dtype)
    out, h = norm(x, residual)
    assert torch.equal(h, residual + x)
    assert torch.equal(out, norm(residual + x))


def textbook_forward(model: MoEForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The decoder as written before the residual moved into the norms."""
    x = model.model.embed_tokens(input_ids)
    for layer in model.model.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), positions)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.model.norm(x)


def check_decoder_against_textbook(monkeypatch: pytest.MonkeyPatch, **llm_options) -> None:
    """Every forward of the demo model (prefill and decode) through `LLM(**llm_options)`: the residual-carrying
    decoder's hidden states equal the textbook form's bit for bit (run second on the same inputs, it rewrites the KV
    cache with the same values)."""
    forward, checked = MoEForCausalLM.forward, []

    def both(self: MoEForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = forward(self, input_ids, positions)
        assert torch.equal(hidden, textbook_forward(self, input_ids, positions))
        checked.append(input_ids.numel())
        return hidden

    monkeypatch.setattr(MoEForCausalLM, "forward", both)
    llm = LLM(progress=False, **llm_options)
    llm.generate(["ROMEO.\n", "To be, or not to be"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(checked) >= 8 and max(checked) > 2  # prefill and decode steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_is_bitwise_the_textbook_form(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_decoder_against_textbook(monkeypatch, dtype=dtype)


def test_no_rows_and_bad_shapes() -> None:
    w = torch.randn(96)
    out, h = add_rms_norm(torch.randn(0, 96), torch.randn(0, 96), w, EPS)
    assert out.shape == h.shape == (0, 96)
    with pytest.raises(ValueError):
        add_rms_norm(torch.randn(2, 96), torch.randn(1, 96), w, EPS)  # no broadcasting
    with pytest.raises(ValueError):
        add_rms_norm(torch.randn(2, 96), torch.randn(2, 96), torch.randn(95), EPS)
    with pytest.raises(ValueError):
        add_rms_norm(torch.randn(2, 96).double(), torch.randn(2, 96), w, EPS)
