"""`--ple-sync wait`: a replayed decode step is launched before its per-layer embedding rows are staged and waits for
them on the GPU.

Inside the captured graph, just before the rows are first used, the stream waits (`cuStreamWaitValue32`, flag >= 1)
on a word of pinned host memory, then resets it (`cuStreamWriteValue32`, 0): wait first, then reset (a reset first
would erase a release that came early, and the step would wait forever). At each replay a filler thread, handed the
fill before the launch (`ReleaseWorker.before_replay`), stages the rows and writes 1, so the disk read overlaps the
launch and the work before the rows' first use. A watchdog writes 1 itself if the fill has not within `timeout`
seconds: a lost release becomes an error (`after_replay`), never a hang. A graph holding such a wait must not have a
first launch that blocks until the GPU gets past the wait: its replay hook says so (`needs_upload`), and
`--graph-upload auto` uploads exactly those graphs at capture.

Off CUDA, or where the driver lacks stream memory operations (or a probe graph using them fails), `make_wait_sync`
returns None with one log line, and the backend syncs on the host (fill, then launch). The driver is called through
ctypes (`libcuda.so.1`), as the copy service calls it.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

from edgemoe.capture import participate
from edgemoe.errors import EdgeMoEError

WAIT_TIMEOUT_S = 60.0  # a decode step stages a few rows: a fill this late is a stalled read, not a slow one
_WAIT_GEQ, _WRITE_DEFAULT = 0x0, 0x0  # CU_STREAM_WAIT_VALUE_GEQ, CU_STREAM_WRITE_VALUE_DEFAULT
_CAN_USE_STREAM_MEM_OPS_V1 = 92  # CU_DEVICE_ATTRIBUTE_: whether the first (pre-_v2) entry points are enabled


def _check(result: int, call: str) -> None:
    if result:
        raise RuntimeError(f"{call} failed with CUDA error {result}")


class StreamMemOps:
    """The driver's 32-bit stream wait and write: the `_v2` entry points (on by default since CUDA 11.7), else the
    first ones where the device attribute says they are enabled; and `cuMemHostGetDevicePointer`."""

    def __init__(self, device_index: int) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        self.wait32 = getattr(cuda, "cuStreamWaitValue32_v2", None)
        self.write32 = getattr(cuda, "cuStreamWriteValue32_v2", None)
        if self.wait32 is None or self.write32 is None:
            device, enabled = ctypes.c_int(), ctypes.c_int()
            _check(cuda.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
            attribute = _CAN_USE_STREAM_MEM_OPS_V1
            _check(cuda.cuDeviceGetAttribute(ctypes.byref(enabled), attribute, device), "cuDeviceGetAttribute")
            if not enabled.value:
                raise RuntimeError("the driver's stream memory operations are disabled (CAN_USE_STREAM_MEM_OPS 0)")
            self.wait32, self.write32 = cuda.cuStreamWaitValue32, cuda.cuStreamWriteValue32
        for call in (self.wait32, self.write32):
            call.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.device_pointer = cuda.cuMemHostGetDevicePointer_v2
        self.device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]


class HostFlag:
    """A 32-bit word of pinned host memory that a stream waits on and the host releases."""

    def __init__(self, ops: StreamMemOps) -> None:
        self.ops = ops
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._value = self.word.numpy()
        address = ctypes.c_uint64()
        _check(ops.device_pointer(ctypes.byref(address), self.word.data_ptr(), 0), "cuMemHostGetDevicePointer")
        self.address = address.value

    def enqueue_wait(self, stream: int) -> None:
        """On `stream` (a capturing one: into its graph): wait until the word is >= 1, then set it back to 0."""
        _check(self.ops.wait32(stream, self.address, 1, _WAIT_GEQ), "cuStreamWaitValue32")
        _check(self.ops.write32(stream, self.address, 0, _WRITE_DEFAULT), "cuStreamWriteValue32")

    def release(self) -> None:
        # After the fill's stores in program order; x86-64 keeps stores in order (an Arm host would need a fence)
        self._value[0] = 1

    @property
    def raised(self) -> bool:
        return bool(self._value[0])


def memops_problem(device: torch.device, probe_timeout: float = 5.0) -> str | None:
    """Why captured waits would not work on `device` (None: they do): the entry points, then a probe graph (a
    wait on a released flag and its reset) captured, replayed and seen to have reset the flag."""
    try:
        with torch.cuda.device(device):
            torch.empty(1, device=device)  # the primary context is current from here (driver calls use it)
            flag = HostFlag(StreamMemOps(torch.cuda.current_device()))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                flag.enqueue_wait(torch.cuda.current_stream().cuda_stream)
            flag.release()
            probe = torch.cuda.Stream()  # a probe that never passed its wait blocks this stream alone
            with torch.cuda.stream(probe):
                graph.replay()
                done = torch.cuda.Event()
                done.record()
            deadline = time.monotonic() + probe_timeout
            while not done.query():
                if time.monotonic() > deadline:
                    return "a probe graph's wait did not see the host's release"
                time.sleep(1e-4)
            return "a probe graph's wait did not reset its flag" if flag.raised else None
    except (OSError, AttributeError, RuntimeError) as exc:  # no libcuda, no entry point, a failing call
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class _Step:
    """One replay's release: written by the filler once the fill is done (or failed), or by the watchdog at the
    deadline; whichever comes first, once, under the worker's lock."""

    def __init__(self, fill: Callable[[], None], write: Callable[[], None], lock: threading.Lock, timeout: float):
        self._fill, self._write, self._lock, self._timeout = fill, write, lock, timeout
        self.done, self.released = threading.Event(), threading.Event()
        self.failure: str | None = None

    def fill_then_release(self) -> None:
        failure = None
        try:
            self._fill()
        except BaseException as exc:  # any failure must still release the GPU, and be reported
            failure = f"staging per-layer embedding rows failed: {type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            self._release(failure)
            self.done.set()

    def watch(self) -> None:
        if not self.done.wait(self._timeout):
            self._release(
                f"per-layer embedding rows were not staged within {self._timeout:g} s (a stalled read?); the step "
                "was released without them"
            )

    def _release(self, failure: str | None) -> None:
        with self._lock:
            if self.released.is_set():
                return
            self.failure = failure
            self._write()
            self.released.set()


def _serve(jobs: queue.SimpleQueue) -> None:
    """A worker thread's loop: run jobs until None (put when its `ReleaseWorker` is collected)."""
    while (job := jobs.get()) is not None:
        job()


class ReleaseWorker:
    """The replay hook of every graph that captured a wait: before the launch, hand the fill to the filler thread
    and arm the watchdog; after it, wait for the release (bounded by the watchdog) and raise what went wrong. After a
    failure the rows' staging buffer may still be written by a stalled fill: every later replay refuses."""

    needs_upload = True  # `edgemoe.engine.cuda_graphs`: the first launch of its graphs must not block

    def __init__(self, fill: Callable[[], None], write: Callable[[], None], timeout: float = WAIT_TIMEOUT_S) -> None:
        self._fill, self._write, self.timeout = fill, write, timeout
        self._lock = threading.Lock()
        self._step: _Step | None = None
        self.error: str | None = None
        self.replays = 0
        self._fills, self._watches = queue.SimpleQueue(), queue.SimpleQueue()
        for jobs, name in ((self._fills, "edgemoe-ple-fill"), (self._watches, "edgemoe-ple-watchdog")):
            threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True).start()
            weakref.finalize(self, jobs.put, None)

    def check(self) -> None:
        """Raise if a fill failed or stalled: the staging buffer may still be written by it."""
        if self.error is not None:
            raise EdgeMoEError(f"{self.error}: the engine cannot decode further")

    def before_replay(self) -> None:
        self.check()
        self._step = step = _Step(self._fill, self._write, self._lock, self.timeout)
        self._watches.put(step.watch)
        self._fills.put(step.fill_then_release)

    def after_replay(self) -> None:
        step, self._step = self._step, None
        self.replays += 1
        if not step.released.wait(self.timeout + 5.0):  # the watchdog releases at the deadline: it cannot be later
            self.error = "the per-layer embedding watchdog did not release the step"
        elif step.failure is not None:
            self.error = step.failure
        if self.error is not None:
            raise EdgeMoEError(self.error)


class WaitSync:
    """A backend's wait: the flag its captured steps wait on and the worker their replays run (`capture`)."""

    def __init__(self, flag: HostFlag, fill: Callable[[], None], timeout: float = WAIT_TIMEOUT_S) -> None:
        self.flag = flag
        self.worker = ReleaseWorker(fill, flag.release, timeout)
        self.captured = 0  # graphs captured with this wait in them

    def capture(self) -> None:
        """Inside a graph capture: the current stream waits for the flag, then resets it; the graph's replays will
        release it (the worker becomes one of its replay hooks)."""
        self.flag.enqueue_wait(torch.cuda.current_stream().cuda_stream)
        self.captured += 1
        participate(self.worker)


def make_wait_sync(device: torch.device, fill: Callable[[], None], timeout: float = WAIT_TIMEOUT_S) -> WaitSync | None:
    """The wait for a backend on `device` whose `fill` stages a step's rows; None (host sync) with one log line off
    CUDA or where the driver cannot wait in a graph."""
    problem = "it needs CUDA" if device.type != "cuda" else memops_problem(device)
    if problem is not None:
        print(f"edgemoe: ple_sync wait: {problem}; syncing on the host instead (fill, then launch)", file=sys.stderr)
        return None
    with torch.cuda.device(device):
        return WaitSync(HostFlag(StreamMemOps(torch.cuda.current_device())), fill, timeout)
