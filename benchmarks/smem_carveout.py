"""One shared-memory carveout for every Triton kernel this process loads (`install(percent)`): each kernel's
`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT` set right after Triton loads it, before its first launch (and
so before any CUDA-graph capture).

Why (session 20, benchmarks/RESULTS.md): in benchmarks/persistent_chain.py's chain of dependent GEMVs, two
alternating builds of the engine's GEMV (different steps or rows, so different shared memory) took 8.8 µs a GEMV
under PDL, one build alternating with itself 6.3-6.6. The suspect was the driver choosing each kernel's L1 /
shared split from its own needs, so that an SM must drain before a kernel with another split can start there, which
PDL's early launch cannot hide; with one preference for all kernels (50 % or 100 %) the two builds took 6.34-6.37.
Resident decode did not gain from it (385.6-385.9 tok/s against 386.5-386.6). Used by
`benchmarks/decode_variants.py --smem-carveout` and, through EDGEMOE_SMEM_CARVEOUT, by the call scripts.
"""

from __future__ import annotations

import ctypes
import functools

CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h's CUfunction_attribute)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def set_carveout(function: int, percent: int) -> None:
    """The preferred carveout (percent of the SM's L1 / shared memory given to shared memory) of one CUfunction."""
    rc = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(function), CARVEOUT_ATTRIBUTE, ctypes.c_int(percent))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(carveout {percent}) failed with CUresult {rc}")


def install(percent: int) -> None:
    """Every Triton kernel loaded from now on gets `percent` (0-100) as its preferred carveout."""
    if not 0 <= percent <= 100:
        raise ValueError(f"a shared-memory carveout is a percentage, 0-100; got {percent}")
    from triton.compiler.compiler import CompiledKernel

    load = CompiledKernel._init_handles

    def init_handles(self):
        fresh = self.module is None
        load(self)
        if fresh and self.module is not None:
            set_carveout(self.function, percent)

    CompiledKernel._init_handles = init_handles
