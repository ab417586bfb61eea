"""The miss copy by the copy engine: the GPU posts each copy list to a mailbox in pinned host memory, a host thread
(`copy_service.c`, compiled at first use with the system's C compiler, which Triton needs too) issues the listed
rows' `cuMemcpyHtoDAsync` on its own stream and marks each entry arrived in the expert cache's arrival counters.

Why: rows read by SMs from pinned memory reach ~0.89 of a pinned memcpy, the copy engine ~0.97-1.0 (the probe in
benchmarks/copy_service.py; benchmarks/RESULTS.md), and the SMs stay free for the experts that hit. The decode
step stays sync-free and graph-capturable: posting is a kernel, waiting is the expert GEMV's per-entry wait. The
host thread never waits for the Python thread, so graph launches need no upload (`--graph-upload auto` = none).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import weakref
from pathlib import Path

import torch

from edgemoe.errors import EdgeMoEError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("copy_service.c")
RING = 2  # mailbox rows: the GPU waits for each list it posts before it posts the next
SPIN_NS = 50_000_000  # busy-poll 50 ms after the last post (a decode step's lists come every few 100 us) ...
NAP_NS = 100_000  # ... then poll every 0.1 ms, so an idle engine does not hold a core


def settle(t: torch.Tensor) -> None:
    """Wait for `t`'s stream before a host read of `t` (or a torch op that reads device values on the host).

    A read that copies to pageable memory (`.tolist()`, `.item()`, `torch.unique`) blocks inside the CUDA driver
    until the stream reaches it, and while blocked there it keeps the copy service's thread out of the driver
    (measured: decode hung with a list posted and unserved). A stream synchronisation waits without doing so, and the
    copy that follows returns at once."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def host_list(t: torch.Tensor) -> list:
    """`t.tolist()`, after `settle(t)`."""
    settle(t)
    return t.tolist()


class _Service(ctypes.Structure):
    _fields_ = [
        ("mailbox", ctypes.c_void_p), ("ring", ctypes.c_int64), ("width", ctypes.c_int64),
        ("max_entries", ctypes.c_int64), ("pool_a", ctypes.c_uint64), ("pool_b", ctypes.c_uint64),
        ("row_a", ctypes.c_int64), ("row_b", ctypes.c_int64), ("counters", ctypes.c_uint64),
        ("chunks", ctypes.c_uint64), ("stream", ctypes.c_void_p), ("context", ctypes.c_void_p),
        ("copy", ctypes.c_void_p), ("write", ctypes.c_void_p), ("set_context", ctypes.c_void_p),
        ("spin_ns", ctypes.c_int64), ("nap_ns", ctypes.c_int64), ("stop", ctypes.c_int), ("error", ctypes.c_int),
        ("served", ctypes.c_int64), ("thread", ctypes.c_uint64),
    ]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL:
    """copy_service.c as a shared library, built once per source version into the temporary directory."""
    source = SOURCE.read_bytes()
    target = Path(tempfile.gettempdir()) / f"edgemoe-copy-service-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not target.exists():
        cc = os.environ.get("CC", "cc")
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", str(partial)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise EdgeMoEError(f"the copy service needs a C compiler ({cc}): {e}") from None
        except subprocess.CalledProcessError as e:
            raise EdgeMoEError(f"building the copy service failed: {e.stderr.strip()}") from None
        os.replace(partial, target)
    lib = ctypes.CDLL(str(target))
    for name in ("edgemoe_copy_service_start", "edgemoe_copy_service_stop"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Service)]
    return lib


class Driver:
    """The CUDA driver entry points the service thread calls, and the context it runs in (torch's)."""

    def __init__(self, device: torch.device) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        self.context = ctypes.c_void_p()
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)  # the primary context is current from here
            if cuda.cuCtxGetCurrent(ctypes.byref(self.context)) or not self.context.value:
                raise EdgeMoEError("no current CUDA context for the copy service")
            self.stream = ctypes.c_void_p()
            if cuda.cuStreamCreate(ctypes.byref(self.stream), 1):  # CU_STREAM_NON_BLOCKING
                raise EdgeMoEError("cannot create the copy service's stream")
        self.functions = [
            ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
            for name in ("cuMemcpyHtoDAsync_v2", "cuStreamWriteValue64_v2", "cuCtxSetCurrent")
        ]


def _stop(lib: ctypes.CDLL, state: _Service, keep: tuple) -> None:
    lib.edgemoe_copy_service_stop(ctypes.byref(state))


class CopyService:
    """One host thread serving one slot pool's copy lists (see the module docstring). `post` is what
    `ExpertCache.copy_missing` launches instead of the SM copy; `close` (also at garbage collection) stops it.

    `driver` is for tests: any object with `context`, `stream` and `functions` (copy, write, set_context as C
    function addresses with the driver's signatures)."""

    def __init__(
        self,
        pools: tuple[torch.Tensor, torch.Tensor],
        counters: torch.Tensor,
        chunks: int,
        max_entries: int,
        driver: Driver | None = None,
    ) -> None:
        device = pools[0].device
        self.driver = driver or Driver(device)
        self.max_entries = max_entries
        self.width = 4 + 2 * max_entries
        pin = device.type == "cuda"
        self.mailbox = torch.zeros((RING, self.width), dtype=torch.int64, pin_memory=pin)
        self.tick = torch.zeros((), dtype=torch.int64, device=device)  # lists posted so far
        self.counters, self.chunks = counters, chunks
        copy, write, set_context = self.driver.functions
        self._state = _Service(
            self.mailbox.data_ptr(), RING, self.width, max_entries, pools[0].data_ptr(), pools[1].data_ptr(),
            pools[0][0].nbytes, pools[1][0].nbytes, counters.data_ptr(), chunks, self.driver.stream.value,
            self.driver.context.value, copy, write, set_context, SPIN_NS, NAP_NS, 0, 0, 0, 0,
        )  # fmt: skip
        lib = library()
        if lib.edgemoe_copy_service_start(ctypes.byref(self._state)):
            raise EdgeMoEError("cannot start the copy service's thread")
        # stopped at close or garbage collection; until then the thread's memory stays alive
        self._finalizer = weakref.finalize(self, _stop, lib, self._state, (self.mailbox, pools, counters))

    def post(self, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, banks: tuple[torch.Tensor, ...]) -> None:
        """Post a copy list (sync-free, graph-capturable): the service copies banks[k][src[i]] to pool k's slot
        dst[i] for i < count and then sets counters[i] to `chunks`. The counters must be zero (ensure zeroes them)."""
        from edgemoe.kernels.miss_copy import post_copy_list

        self.check()
        assert src.numel() <= self.max_entries, "a copy list longer than the mailbox row"
        post_copy_list(src, dst, count, self.tick, self.mailbox, banks, RING, self.max_entries)

    def wait(self, count: torch.Tensor) -> None:
        """For consumers that read the pool without waiting per entry (prefill): the stream waits for every entry."""
        from edgemoe.kernels.miss_copy import await_copy_list

        await_copy_list(count, self.counters, self.chunks)

    @property
    def served(self) -> int:
        return self._state.served

    def check(self) -> None:
        """Raise if the thread hit a CUDA error (it still marks every entry arrived, so the GPU never hangs)."""
        if self._state.error:
            raise EdgeMoEError(f"the expert copy service failed with CUDA error {self._state.error}")

    def close(self) -> None:
        self._finalizer()
