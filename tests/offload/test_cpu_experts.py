"""The CPU expert executor (`edgemoe/offload/cpu_experts.c` through `cpu_experts.py`) against a plain-torch reference:
each pair's expert dequantized by `edgemoe.quant.dequantize` (dense bf16/fp16 widened), then the two matmuls
and the activation (`edgemoe.layers.mlp.ACTIVATIONS`) in float64. Inputs are fresh random: valid random blocks,
randn x, pairs with repeated tokens and an expert shared by more pairs than one read of a row serves (MAXX = 4);
shapes are whole blocks but odd counts of them (the kernels step two blocks at a time) and, dense, no multiple of
any vector width. The AVX2 and plain-C builds are checked as the native one is.

Tolerance, fp32 rounding (the kernels' sums run in another order than any reference's): per output element,
|out - ref| <= 1e-5 |ref| + 4 eps32 (sqrt(I) t2 + sqrt(sum_j (down_j dh_j)^2)). An fp32 sum of K terms errs by about
sqrt(K) eps |its largest term|: t2 is the down row's largest |down_j h_j|; dh_j = sqrt(H) (1.2 |up_j| g_j + |act_j| u_j)
+ |h_j| is what that error in gate_j and up_j (g_j, u_j their rows' largest terms; act' <= 1.2) and h's own rounding
make of h_j, carried through the down sum with random signs. The bound comes to ~1e-5 on outputs of ~1 (the errors
measured: 5-15 % of it); one wrong weight costs ~1e-3.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import tempfile

import pytest
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.layers.mlp import ACTIVATIONS, swiglu_oai
from edgemoe.offload import cpu_experts
from edgemoe.offload.cpu_experts import CpuExperts, Job, build, physical_cores
from edgemoe.offload.layout import ExpertLayout, QuantExpertLayout
from edgemoe.quant import dequantize, quant_type, random_blocks

# case -> (gate_up, down): GGUF formats, or a dense dtype
CASES = {
    "Q8_0": ("Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0"), "MXFP4": ("MXFP4", "MXFP4"), "Q4_K": ("Q4_K", "Q4_K"),
    "Q5_K": ("Q5_K", "Q5_K"), "Q6_K": ("Q6_K", "Q6_K"), "Q4_K_M": ("Q4_K", "Q6_K"), "Q8_0+Q6_K": ("Q8_0", "Q6_K"),
    "Q4_1": ("Q4_1", "Q4_1"), "Q5_0": ("Q5_0", "Q5_0"), "Q5_1": ("Q5_1", "Q5_1"), "Q4_K+Q5_0": ("Q4_K", "Q5_0"),
    "Q5_1+Q4_1": ("Q5_1", "Q4_1"),
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
}  # fmt: skip
X86 = platform.machine() in ("x86_64", "AMD64")
EPS = torch.finfo(torch.float32).eps


def make_layout(case: str, act: str = "silu", pad: int = 0) -> ExpertLayout:
    """Odd block counts: H = 15 x 32 or 3 x 256, I = 3 x 32 or 1 x 256; dense H = 200, I = 37."""
    spec = CASES[case]
    if isinstance(spec, torch.dtype):
        return ExpertLayout(200, 37, spec, act)
    q13, q2 = (quant_type(q) for q in spec)
    hidden, inter = (768 if q13.block_weights == 256 else 480), (256 if q2.block_weights == 256 else 96)
    used = QuantExpertLayout(hidden, inter, q13, q2, torch.float32).used
    return QuantExpertLayout(hidden, inter, q13, q2, torch.float32, row=used + pad, act=act)


def make_bank(layout: ExpertLayout, experts: int, g: torch.Generator) -> torch.Tensor:
    """[experts, row]: random gate_up (std H^-0.5) then down (std I^-0.5), then random padding bytes if any."""
    hidden, inter = layout.hidden, layout.inter
    if isinstance(layout, QuantExpertLayout):
        w13 = random_blocks((experts, 2 * inter, hidden), layout.q_gate_up, g, std=hidden**-0.5)
        w2 = random_blocks((experts, hidden, inter), layout.q_down, g, std=inter**-0.5)
        pad = torch.randint(0, 256, (experts, layout.row - layout.used), generator=g, dtype=torch.uint8)
        return torch.cat([w13.flatten(1), w2.flatten(1), pad], dim=1)
    w13 = torch.randn(experts, 2 * inter * hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden * inter, generator=g) * inter**-0.5
    return torch.cat([w13, w2], dim=1).to(layout.dtype)


def make_pairs(g: torch.Generator, pairs: int = 13, tokens: int = 5, experts: int = 7) -> tuple[torch.Tensor, ...]:
    """tokens, experts int64 [pairs]: random with repeats, and expert 2 in 6 pairs (two groups of one expert)."""
    token_ids = torch.randint(0, tokens, (pairs,), generator=g)
    expert_ids = torch.randint(0, experts, (pairs,), generator=g)
    expert_ids[torch.randperm(pairs, generator=g)[:6]] = 2
    return token_ids, expert_ids


def reference(
    bank: torch.Tensor, layout: ExpertLayout, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
):  # fmt: skip
    """float64 [P, H] outputs and the tolerance of each (the module docstring); `biases` (gate_up [E, 2I], down
    [E, H]) added by expert, as gpt-oss's."""
    w13, w2 = (w[experts] for w in layout.views(bank))  # [P, 2I, *], [P, H, *]
    if isinstance(layout, QuantExpertLayout):
        w13, w2 = dequantize(w13, layout.q_gate_up, layout.hidden), dequantize(w2, layout.q_down, layout.inter)
    w13, w2, xs = w13.double(), w2.double(), x[tokens].double()
    gate_up = (w13 @ xs[:, :, None])[..., 0]
    if biases is not None:
        gate_up = gate_up + biases[0][experts].double()
    gate, up = gate_up.chunk(2, dim=-1)  # [P, I] each
    if layout.act_name == "swiglu_oai":  # its gate factor, and h's slope along gate: at most 1.1 (|up| + 1)
        act, slope = swiglu_oai(gate, up) / (up.clamp(-7, 7) + 1), 1.2 * (up.abs() + 1)
        h = swiglu_oai(gate, up)
    else:
        act, slope = ACTIVATIONS[layout.act_name](gate), 1.2 * up.abs()
        h = act * up
    out = (w2 @ h[:, :, None])[..., 0]  # [P, H]
    if biases is not None:
        out = out + biases[1][experts].double()
    t1 = (w13 * xs[:, None, :]).abs().amax(dim=-1).chunk(2, dim=-1)  # gate's and up's largest term a row: [P, I]
    dh = math.sqrt(layout.hidden) * (slope * t1[0] + act.abs() * t1[1]) + h.abs()  # [P, I]
    t2 = (w2 * h[:, None, :]).abs().amax(dim=-1)  # [P, H]
    carried = (w2 * dh[:, None, :]).square().sum(dim=-1).sqrt()  # dh through the down sum (random signs)
    return out, 4 * EPS * (math.sqrt(layout.inter) * t2 + carried)


def check(pool: CpuExperts, layout: ExpertLayout, seed: int = 0) -> torch.Tensor:
    """One fresh random layer through `pool`, against the reference; returns the output."""
    g = torch.Generator().manual_seed(seed)
    bank = make_bank(layout, 7, g)
    tokens, experts = make_pairs(g)
    x = torch.randn(5, layout.hidden, generator=g)
    out = pool.compute(bank, layout, x, tokens, experts, torch.full((len(tokens), layout.hidden), math.nan))
    ref, atol = reference(bank, layout, x, tokens, experts)
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * ref.abs() + atol).all(), f"worst error {(err / (1e-5 * ref.abs() + atol)).max():.3g} x bound"
    return out


@pytest.fixture(scope="module")
def pool():
    with CpuExperts(2) as p:
        yield p


@pytest.mark.parametrize("case", CASES)
def test_every_format_matches_the_reference(pool: CpuExperts, case: str) -> None:
    check(pool, make_layout(case))


@pytest.mark.parametrize("case", ["Q8_0", "Q4_K_M", "bf16"])
def test_gelu_tanh(pool: CpuExperts, case: str) -> None:
    check(pool, make_layout(case, act="gelu_pytorch_tanh"))


@pytest.mark.parametrize("case", ["MXFP4", "bf16"])
def test_gpt_oss_expert_biases_and_clamped_swiglu(pool: CpuExperts, case: str) -> None:
    """gpt-oss's experts: biases by expert on gate/up (before the activation) and on down, the clamped SwiGLU with
    inputs scaled so that gate and up pass the clamp at 7 in some rows and not in others."""
    layout = make_layout(case, act="swiglu_oai")
    g = torch.Generator().manual_seed(61)
    bank = make_bank(layout, 7, g)
    tokens, experts = make_pairs(g)
    x = torch.randn(5, layout.hidden, generator=g) * 8
    biases = torch.randn(7, 2 * layout.inter, generator=g) * 3, torch.randn(7, layout.hidden, generator=g)
    out = pool.compute(bank, layout, x, tokens, experts, torch.full((len(tokens), layout.hidden), math.nan), biases)
    ref, atol = reference(bank, layout, x, tokens, experts, biases)
    err = (out.double() - ref).abs()
    assert (err <= 1e-5 * ref.abs() + atol).all(), f"worst error {(err / (1e-5 * ref.abs() + atol)).max():.3g} x bound"
    plain = pool.compute(bank, layout, x, tokens, experts, torch.empty(len(tokens), layout.hidden))
    assert (out - plain).abs().max() > 0.1  # the job's biases were read


def test_bank_rows_longer_than_the_layer_uses(pool: CpuExperts) -> None:
    """A pool shared with layers of longer rows: the row stride is the bank's, not the layer's."""
    check(pool, make_layout("Q4_K_M", pad=100), seed=1)


@pytest.mark.parametrize("case", ["Q4_K_M", "Q8_0", "Q5_1", "bf16"])
def test_bitwise_the_same_at_any_thread_count(case: str) -> None:
    layout = make_layout(case)
    outs = []
    for threads in (1, 2, 3):
        with CpuExperts(threads) as p:
            assert p.lib.edgemoe_cpu_experts_threads(p.handle) == threads
            outs.append(check(p, layout, seed=2))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_phase_two_waits_for_every_gate_up_item() -> None:
    """Many small items (1 row each in phase 1), three threads on however few cores: a down row read before its h
    was written would show (a fresh pool's h is new memory, a second run's holds the first run's)."""
    layout, g = ExpertLayout(16384, 64, torch.float32), torch.Generator().manual_seed(6)
    bank = make_bank(layout, 16, g)
    with CpuExperts(3) as p:
        for _ in range(2):
            x, experts = torch.randn(2, layout.hidden, generator=g), torch.randperm(16, generator=g)
            tokens = torch.randint(0, 2, (16,), generator=g)
            out = p.compute(bank, layout, x, tokens, experts, torch.empty(16, layout.hidden))
            ref, atol = reference(bank, layout, x, tokens, experts)
            assert ((out.double() - ref).abs() <= 1e-5 * ref.abs() + atol).all()


def test_the_native_build_names_its_vector_path(pool: CpuExperts) -> None:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    expected = "avx512" if " avx512bw" in flags else "avx2" if " avx2" in flags and " fma" in flags else None
    assert pool.isa == expected if expected else pool.isa in ("avx512", "avx2", "scalar")


@pytest.mark.skipif(not X86, reason="x86 vector paths")
@pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2"), ("x86-64", "scalar")])
@pytest.mark.parametrize("case", CASES)
def test_the_avx2_and_plain_c_paths(march: str, isa: str, case: str) -> None:
    with CpuExperts(2, lib=build(march)) as p:
        assert p.isa == isa
        check(p, make_layout(case, act="gelu_pytorch_tanh" if case == "Q8_0" else "silu"), seed=3)


def test_a_c_caller_runs_the_job_through_the_entry_point(pool: CpuExperts) -> None:
    layout, g = make_layout("Q4_K_M"), torch.Generator().manual_seed(4)
    bank, (tokens, experts), x = make_bank(layout, 7, g), make_pairs(g), torch.randn(5, layout.hidden, generator=g)
    expected = pool.compute(bank, layout, x, tokens, experts, torch.empty(len(tokens), layout.hidden))
    out = torch.zeros_like(expected)
    job = pool.job(bank, layout, x, tokens, experts, out)
    address, handle = pool.c_entry
    run = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Job))(address)
    assert run(handle, ctypes.byref(job)) == 0
    assert torch.equal(out, expected)


def test_no_pairs_is_nothing_to_do(pool: CpuExperts) -> None:
    layout = make_layout("bf16")
    bank, none = make_bank(layout, 2, torch.Generator()), torch.empty(0, dtype=torch.int64)
    out = torch.empty(0, layout.hidden)
    assert pool.compute(bank, layout, torch.randn(1, layout.hidden), none, none, out) is out


def test_inputs_it_cannot_compute_are_clear_errors(pool: CpuExperts) -> None:
    layout, g = make_layout("Q8_0"), torch.Generator().manual_seed(5)
    bank, (tokens, experts), x = make_bank(layout, 7, g), make_pairs(g), torch.randn(5, layout.hidden, generator=g)
    out = torch.empty(len(tokens), layout.hidden)
    args = (bank, layout, x, tokens, experts, out)

    def fails(match: str, *changed: object) -> None:
        with pytest.raises(EdgeMoEError, match=match):
            pool.compute(*(c if c is not None else a for a, c in zip(args, changed + (None,) * 6)))

    fails("out of range", None, None, None, None, experts.clone().fill_(7))
    fails("out of range", None, None, None, tokens.clone().fill_(-1))
    fails("x: expected", None, None, x.bfloat16())
    fails("out: expected", None, None, None, None, None, out[:, :-1])
    fails("bank: expected", bank[:, :-1])
    fails("cannot read experts", None, ExpertLayout(layout.hidden, layout.inter, torch.float64))
    relu = make_layout("Q8_0")
    relu.act_name = "relu"
    fails("computes silu, gelu_pytorch_tanh, swiglu_oai, not relu", None, relu)
    with pytest.raises(EdgeMoEError, match="down biases: expected"):
        pool.compute(*args, (torch.zeros(7, 2 * layout.inter), torch.zeros(7, layout.hidden + 1)))
    # 35: TQ2_0, a GGUF format it does not read
    changes = [
        ("gate_up_format", 35, "format"),
        ("down_offset", 0, "shapes"),
        ("act", 7, "activ"),
        ("gate_up_bias", bank.data_ptr(), "shapes"),
    ]  # one bias array without the other
    for field, value, match in changes:
        job = pool.job(*args)
        setattr(job, field, value)
        with pytest.raises(EdgeMoEError, match=match):
            pool.run(job)
    with pytest.raises(EdgeMoEError, match="at least 1 thread"):
        CpuExperts(0)


def _threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_closing_stops_the_threads() -> None:
    before = _threads_now()
    with CpuExperts(3) as p:
        assert _threads_now() == before + 2  # the caller is the third
    assert _threads_now() == before
    p.close()  # again: nothing
    with pytest.raises(EdgeMoEError, match="closed"):
        check(p, make_layout("bf16"))
    p = CpuExperts(3)
    del p  # collection stops them too
    assert _threads_now() == before


def test_the_default_pool_is_the_physical_cores() -> None:
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
    with CpuExperts() as p:
        assert p.threads == physical_cores()


def test_a_missing_c_compiler_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    build.cache_clear()
    try:
        with pytest.raises(EdgeMoEError, match="the CPU expert executor needs a C compiler"):
            cpu_experts.library()
    finally:
        build.cache_clear()  # later tests build the real one
