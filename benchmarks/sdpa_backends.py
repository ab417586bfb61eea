"""SDPA's CUDA backends at a model's prefill attention: the first call of a query length (what a prompt of a length
never run before pays) and the steady time, per backend, for a whole prompt (causal, grouped K/V as prefill passes
them, `edgemoe/layers/attention.py`).

    python benchmarks/sdpa_backends.py [--lengths 347,4096,16384] [--heads 32 --kv-heads 4 --head-dim 128]
                                       [--backends cudnn,flash,efficient] [--json OUT]

Why: torch 2.11 on the H200 runs cuDNN first when allowed, and cuDNN builds a plan per new shape on the CPU; prefill
allows flash, efficient and math only (`PREFILL_BACKENDS`). This measures what that costs or saves at long prompts.
Each (length, backend) uses a length no earlier row used (+1 per backend), so every first call is a first. Defaults:
qwen3-30b-a3b's attention, bf16, one sequence. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip


def timed(fn, reps: int) -> float:  # noqa: ANN001
    """Mean seconds of `reps` calls, synchronised around them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="347,4096,16384", help="query lengths (whole prompts)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backends", default="cudnn,flash,efficient", help=f"of {','.join(BACKENDS)}")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sdpa_backends: needs CUDA (it times SDPA's CUDA backends)")
    unknown = [b for b in a.backends.split(",") if b not in BACKENDS]
    if unknown:
        sys.exit(f"sdpa_backends: unknown backend(s) {','.join(unknown)}; choose from {','.join(BACKENDS)}")
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        for i, name in enumerate(a.backends.split(",")):
            length = n + i  # a shape no earlier row used
            q = torch.randn(1, a.heads, length, a.head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, a.kv_heads, length, a.head_dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)

            def call(q=q, k=k, v=v) -> torch.Tensor:  # noqa: ANN001
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a.heads != a.kv_heads)

            try:
                with sdpa_kernel(BACKENDS[name]):
                    first = timed(call, 1)
                    steady = timed(call, 20 if length <= 4096 else 5)
            except RuntimeError as e:  # the backend does not take this shape here
                print(f"{length:>6} {name:>9}: not run ({str(e).splitlines()[0][:80]})", file=sys.stderr)
                continue
            rows.append({"tokens": length, "backend": name, "first_ms": first * 1e3, "steady_ms": steady * 1e3})
            print(f"{length:>6} {name:>9}: first {first * 1e3:8.2f} ms, steady {steady * 1e3:8.3f} ms", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
