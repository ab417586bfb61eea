"""The CPU expert executor (issue #34): the host computes (token, expert) pairs of one MoE layer itself, straight
from the layer's host bank (pinned or not), into an fp32 buffer the caller provides (pinned, for the GPU to read).
Each pair's output is y = down_e @ (act(gate_e @ x_t) * (up_e @ x_t)), fp32 [pairs, H], unweighted: the GPU applies
the routing weights and sums in its own fixed order.

The work is `cpu_experts.c` (the pool, the two phases) and `cpu_experts_kernels.h` (one dot kernel per format and
ISA): weights dequantized to fp32 as they are read (dense bf16/fp16/fp32, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K, MXFP4; gate_up and down may differ, as in Q4_K_M files), activations kept in fp32, results bitwise the same at
any thread count. It is compiled at first use like the copy service (`c_library`), with -O3 -march=native since it
runs where it is built: AVX-512, else AVX2 + FMA + F16C, else plain C (`CpuExperts.isa`). A C loop can call it without
Python (`CpuExperts.c_entry` and `job`; the struct in `cpu_experts_job.h`): the copy service's serve loop does, for
the CPU split of replayed decode steps.

AMX and AVX512_BF16 are not used: both multiply bf16 by bf16, which would round the activations to bf16, and the
bf16 case is bound by memory, not arithmetic. Measured (benchmarks/cpu_experts.py, 2-core AVX-512 + AMX dev VM, 8
qwen3-30b-a3b experts of 128): the AVX-512 bf16 kernel reads 13.5 GB/s on one thread, 0.95 of a plain read of the
same memory at that thread count (0.83 on two), and 25-28 GB/s a core when the expert is in cache; faster
arithmetic has nothing left to win.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from pathlib import Path

import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload.c_library import build_library
from edgemoe.offload.layout import ExpertLayout, QuantExpertLayout

SOURCE = Path(__file__).with_name("cpu_experts.c")
KERNELS = SOURCE.with_name("cpu_experts_kernels.h")  # included by SOURCE
JOB = SOURCE.with_name("cpu_experts_job.h")  # included by SOURCE and copy_service.c
DENSE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # dtype -> GGML type id, the C file's format ids
# edgemoe.layers.mlp.GLUS' names -> the C file's ids
ACT_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "swiglu_oai": 2}
ERRORS = {
    1: "an unsupported weight format",
    2: "shapes that do not fit the bank's rows",
    3: "a token or expert index out of range",
    4: "host memory exhausted",
    5: "an unsupported activation",
}  # edgemoe_cpu_experts_run's error codes


class Job(ctypes.Structure):
    """`edgemoe_cpu_job`: one layer's pairs as `edgemoe_cpu_experts_run` reads them (pointers, sizes in elements,
    strides and offsets in bytes). A C caller copies one and sets its own pairs, x and out."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("tokens", ctypes.c_int64), ("bank", ctypes.c_void_p), ("experts", ctypes.c_int64),
        ("row_stride", ctypes.c_int64), ("down_offset", ctypes.c_int64), ("gate_up_format", ctypes.c_int32),
        ("down_format", ctypes.c_int32), ("act", ctypes.c_int32), ("reserved", ctypes.c_int32),
        ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("pairs", ctypes.c_int64),
        ("token_ids", ctypes.c_void_p), ("expert_ids", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
    ]  # fmt: skip


def _cpu_key() -> bytes:
    """What a -march=native build depends on: the CPU's feature flags (a temp dir may outlive a machine move)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine.encode()
    return next((line for line in lines if line.startswith(("flags", "Features"))), "").encode()


@functools.cache
def build(march: str = "native") -> ctypes.CDLL:
    """cpu_experts.c built for `-march={march}`: "native" is the engine's; the tests also build "x86-64-v3" (the
    AVX2 path) and "x86-64" (plain C)."""
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-pthread"]
    key = KERNELS.read_bytes() + JOB.read_bytes() + (_cpu_key() if march == "native" else b"")
    lib = build_library(SOURCE, f"cpu-experts-{march}", "the CPU expert executor", flags, key, libs=("-lm",))
    lib.edgemoe_cpu_experts_create.argtypes, lib.edgemoe_cpu_experts_create.restype = [ctypes.c_int], ctypes.c_void_p
    lib.edgemoe_cpu_experts_destroy.argtypes, lib.edgemoe_cpu_experts_destroy.restype = [ctypes.c_void_p], None
    lib.edgemoe_cpu_experts_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(Job)]
    lib.edgemoe_cpu_experts_threads.argtypes = [ctypes.c_void_p]
    lib.edgemoe_cpu_experts_isa.restype = ctypes.c_char_p
    return lib


def library() -> ctypes.CDLL:
    """The engine's build of cpu_experts.c (for this CPU), built at first use."""
    return build("native")


def physical_cores() -> int:
    """The physical cores this process may run on (SMT siblings counted once), at least 1: the default pool size,
    since two threads of one core share its load and FMA ports."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:  # no topology: each CPU its own core
            cores.add(str(cpu))
    return max(1, len(cores))


def layout_formats(layout: ExpertLayout) -> tuple[int, int, int, int]:
    """(gate_up format, down format, byte offset of down in a row, activation) of `layout`, as the C job names them;
    EdgeMoEError for a layout the executor cannot read."""
    act = ACT_IDS.get(layout.act_name)
    if act is None:
        raise EdgeMoEError(f"the CPU expert executor computes {', '.join(ACT_IDS)}, not {layout.act_name}")
    if isinstance(layout, QuantExpertLayout):
        return layout.q_gate_up.ggml_type, layout.q_down.ggml_type, layout.split, act
    if type(layout) is ExpertLayout and layout.dtype in DENSE:
        return DENSE[layout.dtype], DENSE[layout.dtype], layout.split * layout.dtype.itemsize, act
    raise EdgeMoEError(f"the CPU expert executor cannot read experts laid out as {type(layout).__name__} of "
                       f"{layout.dtype} (dense: {', '.join(str(d) for d in DENSE)}; or GGUF blocks)")  # fmt: skip


def _expect(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        raise EdgeMoEError(f"{name}: expected a contiguous CPU tensor {dtype} {list(shape)}, got {t.device} "
                           f"{t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (strided)'}")  # fmt: skip


class CpuExperts:
    """A pool of `threads` host threads computing routed experts (the module docstring). `threads` counts the caller,
    which works too (default: `physical_cores()`); `lib` is for tests: another build (`build(march)`). Close it (or
    use it as a context manager) to stop the threads; collection stops them too."""

    def __init__(self, threads: int | None = None, lib: ctypes.CDLL | None = None) -> None:
        self.lib = lib or library()
        self.threads = physical_cores() if threads is None else threads
        if self.threads < 1:
            raise EdgeMoEError(f"the CPU expert executor needs at least 1 thread, not {self.threads}")
        self.handle = self.lib.edgemoe_cpu_experts_create(self.threads)
        if not self.handle:
            raise EdgeMoEError(f"cannot start {self.threads} CPU expert threads")
        self._finalizer = weakref.finalize(self, self.lib.edgemoe_cpu_experts_destroy, self.handle)

    @property
    def isa(self) -> str:
        """The vector path compiled: "avx512", "avx2" or "scalar"."""
        return self.lib.edgemoe_cpu_experts_isa().decode()

    @property
    def c_entry(self) -> tuple[int, int]:
        """(address of `int edgemoe_cpu_experts_run(pool, const edgemoe_cpu_job *)`, the pool) for a C caller; it
        returns 0 or an error code (`ERRORS`). Valid until `close`."""
        self._check_open()
        return ctypes.cast(self.lib.edgemoe_cpu_experts_run, ctypes.c_void_p).value, self.handle

    def job(
        self, bank: torch.Tensor, layout: ExpertLayout, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
        out: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Job:  # fmt: skip
        """The job for pairs (tokens[p], experts[p]) of one layer: bank [experts, row] laid out by `layout`, x fp32
        [T, H], tokens and experts int64 [P], out fp32 [P, H] (every tensor contiguous on the CPU); `biases`: the
        layer's expert biases, gate_up [experts, 2I] and down [experts, H] fp32 (`host_biases`). The job points
        into these tensors and keeps them alive."""
        gate_up, down, down_offset, act = layout_formats(layout)
        rows = bank.dim() == 2 and bank.shape[1] == layout.row and bank.stride(1) == 1
        if bank.device.type != "cpu" or bank.dtype != layout.dtype or not rows:
            raise EdgeMoEError(f"bank: expected CPU rows {layout.dtype} [experts, {layout.row}], got {bank.device} "
                               f"{bank.dtype} {list(bank.shape)}")  # fmt: skip
        hidden, pairs = layout.hidden, tokens.numel()
        _expect(x, "x", torch.float32, (x.shape[0] if x.dim() == 2 else -1, hidden))
        _expect(tokens, "tokens", torch.int64, (pairs,))
        _expect(experts, "experts", torch.int64, (pairs,))
        _expect(out, "out", torch.float32, (pairs, hidden))
        b13 = b2 = None
        if biases is not None:
            b13, b2 = biases
            _expect(b13, "gate_up biases", torch.float32, (bank.shape[0], 2 * layout.inter))
            _expect(b2, "down biases", torch.float32, (bank.shape[0], hidden))
        job = Job(
            x.data_ptr(), x.shape[0], bank.data_ptr(), bank.shape[0], bank.stride(0) * bank.element_size(),
            down_offset, gate_up, down, act, 0, hidden, layout.inter, pairs, tokens.data_ptr(), experts.data_ptr(),
            out.data_ptr(), None if b13 is None else b13.data_ptr(), None if b2 is None else b2.data_ptr(),
        )  # fmt: skip
        job.tensors = (bank, x, tokens, experts, out, biases)
        return job

    def run(self, job: Job) -> None:
        """Compute `job` (the calling thread works too; the GIL is released meanwhile)."""
        self._check_open()
        err = self.lib.edgemoe_cpu_experts_run(self.handle, ctypes.byref(job))
        if err:
            raise EdgeMoEError(f"CPU experts: {ERRORS.get(err, f'error {err}')}")

    def compute(
        self, bank: torch.Tensor, layout: ExpertLayout, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
        out: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Each pair's unweighted expert output into `out` [P, H] (returned); arguments as `job`'s."""
        self.run(self.job(bank, layout, x, tokens, experts, out, biases))
        return out

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise EdgeMoEError("the CPU expert executor is closed")

    def close(self) -> None:
        """Stop the threads (idempotent; not while a run is in flight on another thread)."""
        self._finalizer()

    def __enter__(self) -> CpuExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
