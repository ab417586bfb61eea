"""The miss copy by the copy engine, for replayed decode graphs: the graph posts each copy list to a mailbox in
pinned host memory, and the thread that replayed it serves the lists until the step is done (`serve`: a loop in
`copy_service.c`, compiled at first use with the system's C compiler, which Triton needs too), issuing the listed
rows' copies on the service's stream (`cuMemcpyBatchAsync`, BATCH_GROUP entries a call) and marking each entry
arrived in the expert cache's arrival counters, on which the expert GEMV waits.

Why: copy-engine copies reach a larger share of a pinned memcpy than SMs reading pinned memory, and leave the SMs
to the experts that hit (docs/findings.md, "Miss copy").
Only captured steps post (the fused `ensure` itself, as soon as its victims are chosen: `PostTarget`); eager steps
keep the SM copy, since their thread runs ahead of the GPU launching kernels and cannot also serve it. The services
a capture posted to join it as participants (`edgemoe.capture.participate`): the graph's replay hooks, so each
replay serves them.

With the CPU split (`attach_cpu`), a list may also carry pairs that the host computes: after queueing the list's
copies, the serving thread runs the CPU expert executor on them through its C entry point, copies their rows to the
device buffer the expert kernels read and sets the flag they wait on (`edgemoe.kernels.protocol.CpuWait`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from edgemoe.capture import participate
from edgemoe.errors import EdgeMoEError
from edgemoe.kernels.protocol import RING, CpuWait, PostTarget, row_width
from edgemoe.offload.c_library import build_library
from edgemoe.offload.cpu_experts import ERRORS, JOB, CpuExperts, Job
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.ram_tier import RamTier

SOURCE = Path(__file__).with_name("copy_service.c")
CPU_BAD_LIST = 100  # copy_service.c's code for a CPU section it cannot serve
BATCH_GROUP = 2  # entries a batched copy call covers (each group's counters written after it): docs/findings.md


class HostTimings(NamedTuple):
    """The serve loop's host-side costs, summed over lists (`CopyService.host_timings`)."""

    lists: int
    first_ns: int  # from seeing a list to the return of its first copy call: the first copy is queued
    issue_ns: int  # from seeing a list to its last counter write: every copy queued
    queries: int  # event queries between lists (each a driver call, the poll loop's)

    def since(self, earlier: HostTimings) -> dict:
        """Per list over the serves between `earlier` and these: µs to the first copy queued, to all queued, and the
        event queries (None without lists)."""
        lists = self.lists - earlier.lists
        if lists <= 0:
            return {"lists": 0, "first_copy_queued_us": None, "all_queued_us": None, "queries_per_list": None}
        return {
            "lists": lists,
            "first_copy_queued_us": (self.first_ns - earlier.first_ns) / lists / 1e3,
            "all_queued_us": (self.issue_ns - earlier.issue_ns) / lists / 1e3,
            "queries_per_list": (self.queries - earlier.queries) / lists,
        }


class _Service(ctypes.Structure):
    _fields_ = [
        ("mailbox", ctypes.c_void_p), ("ring", ctypes.c_int64), ("width", ctypes.c_int64),
        ("max_entries", ctypes.c_int64), ("pool_a", ctypes.c_uint64), ("pool_b", ctypes.c_uint64),
        ("row_a", ctypes.c_int64), ("row_b", ctypes.c_int64), ("stride_a", ctypes.c_int64),
        ("stride_b", ctypes.c_int64), ("joined", ctypes.c_int64), ("counters", ctypes.c_uint64),
        ("chunks", ctypes.c_uint64), ("stream", ctypes.c_void_p), ("copy", ctypes.c_void_p),
        ("write", ctypes.c_void_p), ("query", ctypes.c_void_p), ("batch", ctypes.c_void_p), ("group", ctypes.c_int64),
        ("served", ctypes.c_int64), ("error", ctypes.c_int), ("first_ns", ctypes.c_int64), ("issue_ns", ctypes.c_int64),
        ("queries", ctypes.c_int64), ("cpu_run", ctypes.c_void_p), ("cpu_pool", ctypes.c_void_p),
        ("cpu_jobs", ctypes.c_void_p), ("cpu_layers", ctypes.c_int64), ("max_pairs", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64), ("hidden", ctypes.c_int64), ("cpu_x", ctypes.c_void_p),
        ("cpu_rows", ctypes.c_void_p), ("cpu_scratch", ctypes.c_void_p), ("cpu_pairs", ctypes.c_void_p),
        ("cpu_out", ctypes.c_uint64), ("cpu_done", ctypes.c_uint64), ("cpu_error", ctypes.c_int),
        ("cpu_lists", ctypes.c_int64), ("cpu_ns", ctypes.c_int64), ("tier_fetch", ctypes.c_void_p),
        ("tier", ctypes.c_void_p), ("tier_b", ctypes.c_int64), ("tier_error", ctypes.c_int),
    ]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL:
    """copy_service.c as a shared library, built once per source version into the temporary directory."""
    lib = build_library(SOURCE, "copy-service", "the copy service", ["-O2"], key=JOB.read_bytes())
    lib.edgemoe_copy_service_serve.argtypes = [ctypes.POINTER(_Service), ctypes.c_void_p]
    return lib


@functools.cache
def _service_stream(index: int) -> ctypes.c_void_p:
    """The copy services' stream on device `index`: one per process, shared by every engine there. A stream each
    service owned would have to be destroyed when its engine is collected, which can fall inside another engine's
    graph capture (as a graph freed mid-capture once invalidated one: `capture_graph`); services that serve at once
    only queue behind each other's copies, which cross the same PCIe link anyway."""
    stream = ctypes.c_void_p()
    with torch.cuda.device(index):
        torch.empty(1, device=f"cuda:{index}")  # the primary context is current from here
        if ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(stream), 1):  # CU_STREAM_NON_BLOCKING
            raise EdgeMoEError("cannot create the copy service's stream")
    return stream


class Driver:
    """The CUDA driver entry points `serve` calls (libcuda's; `cuMemcpyBatchAsync` where the driver has it, else
    None), and the device's copy-service stream (`_service_stream`)."""

    def __init__(self, device: torch.device) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        self.stream = _service_stream(device.index if device.index is not None else torch.cuda.current_device())
        self.functions = [
            ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
            for name in ("cuMemcpyHtoDAsync_v2", "cuStreamWriteValue64_v2", "cuEventQuery")
        ]
        self._event: torch.cuda.Event | None = None  # created at first use, on the device current then
        batch = getattr(cuda, "cuMemcpyBatchAsync_v2", None)  # CUDA 13's signature (12.8's has a failIdx more)
        self.functions.append(ctypes.cast(batch, ctypes.c_void_p).value if batch is not None else None)

    def event(self) -> int:
        """A CUDA event recorded on the current stream (its handle): what `serve` waits for. One event, recorded
        again each step: `serve` returns only once it has completed, so no record is ever pending."""
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()
        return self._event.cuda_event


class CopyService:
    """One slot pool's copy lists, posted by captured decode steps (see the module docstring).

    `group`: entries whose rows go in one batched copy call, where the driver has one (0: a copy call per row, as
    without one). `driver` is for tests: any object with `stream`, `functions` (copy, write, query, batch or None,
    as C function addresses with the driver's signatures) and `event()` (a handle `query` accepts)."""

    def __init__(
        self,
        pools: tuple[torch.Tensor, torch.Tensor],
        counters: torch.Tensor,
        chunks: int,
        max_entries: int,
        group: int = BATCH_GROUP,
        driver: Driver | None = None,
        max_pairs: int = 0,
    ) -> None:
        device = pools[0].device
        self.driver = driver or Driver(device)
        self.max_entries, self.max_pairs, self.device = max_entries, max_pairs, device
        self.mailbox = torch.zeros(
            (RING, row_width(max_entries, max_pairs)), dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        self.tick = torch.zeros((), dtype=torch.int64, device=device)  # lists posted so far
        self.counters, self.chunks = counters, chunks
        copy, write, query, batch = self.driver.functions
        rows = [pool[0].nbytes for pool in pools]
        self.strides = [pool.stride(0) * pool.element_size() for pool in pools]
        joined = pools[1].data_ptr() == pools[0].data_ptr() + rows[0] and self.strides == [sum(rows)] * 2
        self._state = _Service(
            self.mailbox.data_ptr(), RING, self.mailbox.shape[1], max_entries, pools[0].data_ptr(),
            pools[1].data_ptr(), *rows, *self.strides, joined, counters.data_ptr(), chunks, self.driver.stream.value,
            copy, write, query, batch if group > 0 else None, group, 0, 0, 0, 0, 0, None, None, None, 0, max_pairs,
        )  # fmt: skip
        self._keep = pools  # the service copies into them
        self.cpu: _CpuSection | None = None  # once `attach_cpu` ran
        library()  # built now: a missing C compiler fails the engine's start, not its first decode step

    def attach_cpu(
        self, pool: CpuExperts, layers: list[tuple[torch.Tensor, ExpertLayout, tuple | None]], max_tokens: int
    ) -> None:
        """Serve lists with CPU pairs from now on (see copy_service.c): `pool` computes them from `layers`' banks
        (bank [experts, row], layout and expert biases or None of each MoE layer, in order), for steps of at most
        `max_tokens` tokens (max_tokens x top_k <= max_pairs). Before any capture that posts them."""
        self.cpu = _CpuSection(pool, layers, max_tokens, self.max_pairs, self.device)
        self.cpu.fill(self._state)

    def attach_tier(self, tier: RamTier, b_offset: int) -> None:
        """Serve lists from `tier`'s RAM rows from now on (copy_service.c): each list names its MoE layer and its
        experts (`tier_target`), fetched into RAM (read from disk where absent) before their copies are queued;
        `b_offset`: bytes from a row's start to its second part. Before any capture that posts them."""
        self._state.tier_fetch, self._state.tier = tier.c_entry
        self._state.tier_b = b_offset
        self._tier = tier  # the serve loop calls into it

    def tier_target(self, layer: int) -> PostTarget:
        """`target` for a layer whose experts are in the RAM tier: the list's bank fields carry MoE layer `layer`."""
        self._record()
        cpu_x = None if self.cpu is None else self.cpu.x
        return PostTarget(self.tick, self.mailbox, layer, layer, RING, self.max_entries, self.max_pairs, cpu_x)

    def detach_cpu(self) -> None:
        """Forget the executor (before it is closed): a list with CPU pairs is then an error, its flag still written
        (the buffers stay)."""
        self._state.cpu_run = self._state.cpu_pool = None

    def cpu_wait(self, count: torch.Tensor) -> CpuWait:
        """What the readers of a captured step's CPU rows wait on; `count`: its `Ensured.cpu_count`."""
        return CpuWait(self.cpu.rows, self.cpu.done, self.tick, count)

    @property
    def joined(self) -> bool:
        """An expert's two rows are one run of memory in each slot, so an entry is one copy (where the banks are
        laid out so too)."""
        return bool(self._state.joined)

    def _check(self, banks: tuple[torch.Tensor, ...]) -> None:
        strides = [bank.stride(0) * bank.element_size() for bank in banks]
        assert strides == self.strides, f"bank rows {strides} bytes apart, the pool's slots {self.strides}"

    def target(self, banks: tuple[torch.Tensor, ...]) -> PostTarget:
        """Where a kernel that posts a list itself (`edgemoe.kernels.miss_copy.post_list`, inside `ensure`) writes it,
        for copies from `banks`; the caller launches that kernel next (it counts as a post, as `post` does)."""
        self._check(banks)
        self._record()
        cpu_x = None if self.cpu is None else self.cpu.x
        return PostTarget(self.tick, self.mailbox, banks[0].data_ptr(), banks[1].data_ptr(), RING, self.max_entries,
                          self.max_pairs, cpu_x)  # fmt: skip

    def _record(self) -> None:
        participate(self)  # inside a capture: the graph's replays must serve this service

    def wait(self, count: torch.Tensor) -> None:
        """For consumers that read the pool without waiting per entry: the stream waits for every entry."""
        from edgemoe.kernels.miss_copy import await_copy_list

        await_copy_list(count, self.counters, self.chunks)

    def before_replay(self) -> None:
        pass

    def after_replay(self) -> None:
        self.serve()

    def serve(self) -> None:
        """Serve the lists the work queued so far posts, until it has all run (a host wait, the step's)."""
        err = library().edgemoe_copy_service_serve(ctypes.byref(self._state), self.driver.event())
        if self._state.tier_error:
            raise EdgeMoEError(self._tier.failure(self._state.tier_error))
        if err:
            raise EdgeMoEError(f"the expert copy service failed with CUDA error {err}")
        if self._state.cpu_error:
            code = self._state.cpu_error
            why = "a list it cannot serve" if code == CPU_BAD_LIST else ERRORS.get(code, f"error {code}")
            raise EdgeMoEError(f"the expert copy service's CPU experts failed: {why}")

    @property
    def served(self) -> int:
        return self._state.served

    @property
    def host_timings(self) -> HostTimings:
        """What serving has cost the host so far (sums; differences of two readings cover the calls between)."""
        st = self._state
        return HostTimings(st.served, st.first_ns, st.issue_ns, st.queries)

    @property
    def cpu_timings(self) -> tuple[int, int]:
        """(lists with CPU pairs served, host ns from seeing each to its flag's write queued), sums so far."""
        return self._state.cpu_lists, self._state.cpu_ns


class _CpuSection:
    """The host and device buffers of a service's CPU pairs (copy_service.c's `cpu_*` fields) and the executor's
    per-layer jobs."""

    def __init__(
        self, pool: CpuExperts, layers: list[tuple[torch.Tensor, ExpertLayout]], max_tokens: int, max_pairs: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        if max_pairs < 1 or max_tokens < 1 or not layers:
            raise EdgeMoEError(f"a service with CPU pairs needs room for them, not {max_pairs} pairs, {max_tokens} "
                               f"rows and {len(layers)} layers")  # fmt: skip
        hidden = layers[0][1].hidden
        pin = device.type == "cuda"
        self.pool, self.hidden, self.max_tokens = pool, hidden, max_tokens
        self.x = torch.zeros(RING, max_tokens, hidden, pin_memory=pin)  # written by the posting kernel
        self.host_rows = torch.zeros(max_pairs, hidden, pin_memory=pin)
        self.scratch = torch.zeros(max_pairs, hidden)
        self.pairs = torch.zeros(3, max_pairs, dtype=torch.int64)
        self.rows = torch.zeros(max_pairs, hidden, device=device)
        self.done = torch.zeros((), dtype=torch.int64, device=device)
        none, empty = torch.zeros(0, dtype=torch.int64), torch.zeros(0, hidden)
        jobs = [pool.job(bank, layout, self.x[0], none, none, empty, biases) for bank, layout, biases in layers]
        if any(layout.hidden != hidden for _, layout, _ in layers):
            raise EdgeMoEError("the layers' experts differ in hidden size")
        self.jobs = (Job * len(jobs))(*jobs)
        self._keep = jobs  # their tensors (the banks)

    def fill(self, st: _Service) -> None:
        st.cpu_run, st.cpu_pool = self.pool.c_entry
        st.cpu_jobs, st.cpu_layers = ctypes.addressof(self.jobs), len(self.jobs)
        st.max_tokens, st.hidden = self.max_tokens, self.hidden
        st.cpu_x, st.cpu_rows, st.cpu_scratch = self.x.data_ptr(), self.host_rows.data_ptr(), self.scratch.data_ptr()
        st.cpu_pairs, st.cpu_out, st.cpu_done = self.pairs.data_ptr(), self.rows.data_ptr(), self.done.data_ptr()
