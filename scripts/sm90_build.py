"""Build the engine's newest Triton kernels for sm_90 (H100 / H200) on a machine without a GPU: each launcher runs on
CPU tensors with its kernel replaced by a recorder, and Triton compiles the real kernel with the recorded arguments
(constexprs as launched, pointers typed by dtype). Per kernel: the shared memory it asks for. Exit 1 if one fails to
compile or asks for more than an H100 block may have (232,448 bytes), which Triton's interpreter never checks: the
first build of the Gated DeltaNet prefill scan asked for 255,232 bytes in fp32.

    python scripts/sm90_build.py [--only moe,gated_delta]      (repository root; needs no GPU, ~2 minutes)

Shapes are the real models' (gpt-oss's experts with biases and the clamped SwiGLU, Qwen3-Next's linear attention,
GLM-4.5's router).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SHARED_LIMIT = 232_448  # bytes of shared memory an H100 (sm_90) block may opt into
POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
           torch.int32: "i32", torch.uint8: "u8"}  # fmt: skip


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the arguments by name."""

    def __init__(self, kernel) -> None:  # noqa: ANN001 - a triton JITFunction
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs) -> None:
            named = dict(zip(self.kernel.arg_names, args))
            named.update({k: v for k, v in kwargs.items() if k in self.kernel.arg_names})
            self.calls.append((named, {k: v for k, v in kwargs.items() if k not in named}))

        return launch


def shared_bytes(kernel, args: dict, options: dict) -> int:  # noqa: ANN001
    """`kernel` compiled for sm_90 with `args` -> the shared memory it asks for."""
    constexprs, signature = {}, {}
    for i, param in enumerate(kernel.params):
        value = args[param.name]
        if param.name == "RNE_BY_HAND":  # True for the recorded CPU launch; a GPU launch rounds in hardware and
            value = False  # takes the libdevice branches, so build those
        if param.is_constexpr or value is None or isinstance(value, (str, bool)):
            constexprs[(i,)], signature[param.name] = value, "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + POINTEE[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
    keep = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options=keep)  # fmt: skip
    return compiled.metadata.shared


def build(label: str, module, names: list[str], launch: Callable, *args, **kwargs) -> bool:  # noqa: ANN001
    """Run `launch(*args, **kwargs)` with `module`'s kernels `names` recorded, then build each one's first launch;
    print a line each."""
    recorders = {name: Recorder(getattr(module, name)) for name in names}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        launch(*args, **kwargs)
    finally:
        for name, recorder in recorders.items():
            setattr(module, name, recorder.kernel)
    ok = True
    for name, recorder in recorders.items():
        args, options = recorder.calls[0]
        try:
            shared = shared_bytes(recorder.kernel, args, options)
        except Exception as exc:  # noqa: BLE001 - a compile error, reported in one line
            print(f"FAIL {label} {name}: {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}", flush=True)
            ok = False
            continue
        fits = shared <= SHARED_LIMIT
        ok &= fits
        print(f"{'ok  ' if fits else 'FAIL'} {label} {name}: {shared:,} bytes of shared memory", flush=True)
    return ok


def experts() -> bool:
    """gpt-oss-20b's expert shapes (2,880 x 2,880, top 4 of 32): bf16 decode and prefill, MXFP4 decode; biases and
    the clamped SwiGLU, and the plain SiLU path."""
    from edgemoe.kernels import grouped_gemm, moe_gemv, quant_gemv
    from edgemoe.kernels.protocol import PairBiases
    from edgemoe.quant import random_blocks

    E, H, inter, K, bf = 32, 2880, 2880, 4, torch.bfloat16
    x, ids, weights = torch.randn(2, H).to(bf), torch.randint(0, E, (2, K)), torch.rand(2, K)
    w13, w2 = torch.empty(E, 2 * inter, H, dtype=bf), torch.empty(E, H, inter, dtype=bf)
    bias = PairBiases(torch.randn(E, 2 * inter), torch.randn(E, H), ids.flatten())
    xs, ids64 = torch.randn(64, H).to(bf), torch.randint(0, E, (64, K))
    bias64 = PairBiases(bias.gate_up, bias.down, ids64.flatten())
    g = torch.Generator().manual_seed(0)
    q13 = random_blocks((E, 2 * inter, H), "MXFP4", g, std=0.02)
    q2 = random_blocks((E, H, inter), "MXFP4", g, std=0.02)
    ok = True
    for act, b, b64 in (("silu", None, None), ("swiglu_oai", bias, bias64)):
        ok &= build(f"moe_gemv {act}", moe_gemv, ["_up", "_down"], moe_gemv.fused_experts, x, ids, weights, w13, w2,
                    bias=b, act=act)  # fmt: skip
        ok &= build(f"grouped_gemm {act}", grouped_gemm, ["_gate_up", "_down"], grouped_gemm.grouped_gemm, xs, ids64,
                    torch.rand(64, K), w13, w2, bias=b64, act=act)  # fmt: skip
        ok &= build(f"quant_gemv MXFP4 {act}", quant_gemv, ["_up", "_down"], quant_gemv.quant_fused_experts, x, ids,
                    weights, q13, q2, "MXFP4", "MXFP4", inter, H, bias=b, act=act)  # fmt: skip
    return ok


def gated_delta() -> bool:
    """Qwen3-Next's linear attention (16 q/k heads, 32 value heads of 128): decode, its gated norm and prefill, fp32
    and bf16."""
    from edgemoe.kernels import gated_delta as decode
    from edgemoe.kernels import gated_delta_prefill as prefill
    from edgemoe.kernels import norm_rope

    kh, vh, kd, vd = 16, 32, 128, 128
    channels = 2 * kh * kd + vh * vd
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        ok &= build(f"gated_delta decode {dtype}", decode, ["_conv_decode", "_delta_rule_decode"],
                    decode.gated_delta_decode, torch.randn(4, channels).to(dtype), torch.rand(4, vh).to(dtype),
                    torch.rand(4, vh).to(dtype), -torch.rand(vh), torch.rand(vh).to(dtype), torch.arange(4),
                    torch.randn(channels, 1, 4).to(dtype),
                    torch.zeros(5, channels, 3).to(dtype), torch.zeros(5, vh, kd, vd), kh, False)  # fmt: skip
        x, z = torch.randn(4, vh, vd).to(dtype), torch.randn(4, vh, vd).to(dtype)
        ok &= build(f"gated norm {dtype}", norm_rope, ["_gated_rms_norm"], norm_rope.gated_rms_norm, x, z,
                    torch.ones(vd).to(dtype), 1e-6)  # fmt: skip
        ok &= build(f"gated_delta prefill {dtype}", prefill, ["_chunk_inverse", "_chunk_scan"],
                    prefill.delta_rule_prefill, torch.randn(300, channels).to(dtype), torch.rand(300, vh).to(dtype),
                    -torch.rand(300, vh), torch.zeros(5, vh, kd, vd), torch.tensor([1, 3]),
                    torch.tensor([0, 200, 300]), 200, kh, False)  # fmt: skip
    return ok


def routers() -> bool:
    """GLM-4.5's grouped sigmoid router (fp32 gate over bf16 activations, 160 experts; DeepSeek-style 8 groups)."""
    from edgemoe.kernels import router

    ok = True
    for E, n_group, topk_group in ((160, 1, 1), (256, 8, 4)):
        ok &= build(f"grouped router {E} experts, {n_group} groups", router, ["_gate_gemv", "_route_grouped"],
                    router.grouped_route, torch.randn(4, 4096).to(torch.bfloat16), torch.randn(E, 4096),
                    torch.randn(E), 8, n_group, topk_group, True, 2.5, torch.ones(4, dtype=torch.bool))  # fmt: skip
    return ok


GROUPS = {"moe": experts, "gated_delta": gated_delta, "routers": routers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    a = ap.parse_args()
    from edgemoe.kernels import pdl

    pdl.use_pdl = lambda device: True  # build the launches as on an H100 (PDL on)
    wanted = [w for w in a.only.split(",") if w]
    unknown = [w for w in wanted if w not in GROUPS]
    if unknown:
        ap.error(f"--only: {', '.join(unknown)} not among {', '.join(GROUPS)}")
    ok = all([GROUPS[w]() for w in wanted])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
