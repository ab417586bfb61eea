"""The copy service's serve loop (`edgemoe/offload/copy_service.c`, built with the system's C compiler) on the CPU: the
CUDA driver entry points it calls are ctypes callbacks over host memory (a memmove for `cuMemcpyHtoDAsync`, memmoves
for `cuMemcpyBatchAsync`, a plain store for `cuStreamWriteValue64`, and for `cuEventQuery` a stand-in GPU that posts
the next list, as `edgemoe.kernels.miss_copy.post_copy_list` writes it, once the last one's entries are marked
arrived). Checked against `copy_rows_reference`: every listed row lands in its slot, each entry's counter is set once
its rows are in, lists are served in order across the ring of mailbox rows, serving ends with the event, a
failing copy is reported while the waiters are still released, and an expert whose two rows are one run of memory
(the engine's layout) is one copy."""

from __future__ import annotations

import ctypes
import tempfile

import pytest
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload import copy_service
from edgemoe.offload.copy_service import RING, CopyService
from edgemoe.offload.expert_cache import copy_rows_reference
from edgemoe.offload.layout import split_rows

E, S, CHUNKS = 10, 6, 7
NOT_READY = 600
COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
WRITE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
SIZES = ctypes.POINTER(ctypes.c_size_t)
ADDRESSES = ctypes.POINTER(ctypes.c_uint64)
BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int, ADDRESSES, ADDRESSES, SIZES, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int), SIZES, ctypes.c_size_t,
    ctypes.c_void_p,
)  # fmt: skip


class HostGPU:
    """The driver entry points over host memory, and a GPU that posts `lists` one by one: each `cuEventQuery` is
    the GPU's turn, which posts the next list once every entry of the last one is marked arrived (the expert GEMV
    waits on them) and reports the event complete after the last. `fail_copy_at`: the copy call (0-based) that
    returns error 700 (in a batch: the batch holding it). `batched`: the driver has `cuMemcpyBatchAsync`."""

    def __init__(self, lists: list, fail_copy_at: int = -1, batched: bool = False) -> None:
        self.lists, self.fail_copy_at = list(lists), fail_copy_at
        self.copies, self.writes, self.queries, self.batches = 0, [], 0, []
        self.service: CopyService | None = None
        self.stream = ctypes.c_void_p(2)

        def copy(dst: int, src: int, size: int, stream: int) -> int:
            self.copies += 1
            if self.copies - 1 == self.fail_copy_at:
                return 700
            ctypes.memmove(dst, src, size)
            return 0

        def write(stream: int, addr: int, value: int, flags: int) -> int:
            counter = ctypes.c_int64.from_address(addr)
            self.writes.append((addr, counter.value, value))  # the counter's value before the write
            counter.value = value
            return 0

        def batch(dsts, srcs, sizes, count: int, attrs, attr_idxs, num_attrs: int, stream: int) -> int:
            self.batches.append((count, num_attrs, attr_idxs[0], attrs[0]))  # (asserts here would be swallowed)
            failed = self.copies <= self.fail_copy_at < self.copies + count
            for k in range(count):
                copy(dsts[k], srcs[k], sizes[k], stream)
            return 700 if failed else 0

        self._callbacks = [COPY(copy), WRITE(write), QUERY(self.query), BATCH(batch)]  # kept alive with the driver
        self.functions = [ctypes.cast(f, ctypes.c_void_p).value for f in self._callbacks]
        if not batched:
            self.functions[3] = None

    def event(self) -> int:
        return 1

    def query(self, event: int) -> int:
        self.queries += 1
        service = self.service
        pending = int(service.tick) > service.served
        if pending:
            return NOT_READY
        if self.lists:
            service.counters.zero_()  # as ensure does before each list
            post(service, *self.lists.pop(0))
            return NOT_READY
        return 0


def post(service: CopyService, src: torch.Tensor, dst: torch.Tensor, banks: tuple[torch.Tensor, ...]) -> int:
    """What the GPU's post kernel writes: the row's fields, then its sequence number (`tick` + 1) last."""
    seq = int(service.tick) + 1
    service.tick.fill_(seq)
    row, width = service.mailbox[(seq - 1) % RING], service.max_entries
    row[1:4] = torch.tensor([src.numel(), banks[0].data_ptr(), banks[1].data_ptr()])
    row[4 : 4 + src.numel()] = src
    row[4 + width : 4 + width + dst.numel()] = dst
    row[0] = seq
    return seq


def make(lists_of, fail_copy_at: int = -1, batched: bool = False, group: int = 1, joined: bool = False):
    """`joined`: banks and pools hold an expert's two rows side by side (`split_rows`, the engine's layout)."""
    gen = torch.Generator().manual_seed(3)
    if joined:
        banks = [split_rows(torch.randn(E, 36, generator=gen), 3, 4) for _ in range(3)]
        pools = split_rows(torch.zeros(S + 1, 36), 3, 4)
    else:
        banks = [(torch.randn(E, 6, 4, generator=gen), torch.randn(E, 4, 3, generator=gen)) for _ in range(3)]
        pools = torch.zeros(S + 1, 6, 4), torch.zeros(S + 1, 4, 3)
    counters = torch.zeros(E, dtype=torch.int64)
    gpu = HostGPU(lists_of(banks), fail_copy_at, batched)
    gpu.service = CopyService(pools, counters, CHUNKS, E, group=group, driver=gpu)
    return gpu, pools, banks, counters


@pytest.mark.parametrize("joined", [False, True], ids=["two-rows", "joined"])
@pytest.mark.parametrize(("batched", "group"), [(False, 1), (True, 1), (True, 3)])
def test_serve_copies_every_list_in_order_into_its_slots(batched: bool, group: int, joined: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    steps = [(s % 3, 1 + s % 4) for s in range(3 * RING + 1)]  # around the ring of mailbox rows several times
    lists = [(torch.randperm(E, generator=gen)[:n], torch.randperm(S, generator=gen)[:n], layer) for layer, n in steps]
    gpu, pools, banks, counters = make(
        lambda banks: [(src, dst, banks[layer]) for src, dst, layer in lists], batched=batched, group=group,
        joined=joined,
    )  # fmt: skip
    assert gpu.service.joined == joined
    want = tuple(p.clone() for p in pools)
    for src, dst, layer in lists:
        for w, bank in zip(want, banks[layer]):
            copy_rows_reference(w, bank, src, dst)
    before = gpu.service.host_timings
    gpu.service.serve()
    assert gpu.service.served == len(lists) and not gpu.lists
    timings = gpu.service.host_timings
    assert timings.lists == len(lists) and timings.queries == gpu.queries  # each poll's driver query, counted
    assert 0 < timings.first_ns <= timings.issue_ns  # the first copy is queued before the list's last write
    per_list = timings.since(before)
    assert per_list["lists"] == len(lists) and per_list["queries_per_list"] == gpu.queries / len(lists)
    assert per_list["first_copy_queued_us"] == timings.first_ns / len(lists) / 1e3
    for pool, w in zip(pools, want):
        assert torch.equal(pool, w)  # every row in its slot, later lists over earlier ones
    n_last = lists[-1][0].numel()
    assert counters[:n_last].tolist() == [CHUNKS] * n_last and not counters[n_last:].any()
    per_entry = 1 if joined else 2  # joined: both rows in one copy
    assert gpu.copies == per_entry * sum(n for _, n in steps)
    if batched:  # each list in groups of `group` entries, the last one shorter
        want_batches = [per_entry * min(group, n - i) for _, n in steps for i in range(0, n, group)]
        assert [count for count, *_ in gpu.batches] == want_batches
        assert {tuple(rest) for _, *rest in gpu.batches} == {(1, 0, 1)}  # one attribute from copy 0: stream order
    entries = [(a - counters.data_ptr()) // 8 for a, _, _ in gpu.writes]
    assert entries == [i for _, n in steps for i in range(n)]  # each list's entries, in order, once
    assert all(before == 0 and value == CHUNKS for _, before, value in gpu.writes)


def test_joined_pools_copy_banks_of_other_layouts_row_by_row() -> None:
    """Joined pools, and banks with the same row spacing that are not one run an expert (two layers' halves): two
    copies an entry, still into the right slots. Banks spaced unlike the pool are refused before anything posts."""
    gen = torch.Generator().manual_seed(5)
    halves = [split_rows(torch.randn(E, 36, generator=gen), 3, 4) for _ in range(2)]
    mixed = (halves[0][0], halves[1][1])
    src, dst = torch.tensor([3, 0, 7]), torch.tensor([5, 1, 2])
    gpu, pools, _, counters = make(lambda banks: [(src, dst, mixed)], batched=True, group=2, joined=True)
    want = tuple(p.clone() for p in pools)
    for w, bank in zip(want, mixed):
        copy_rows_reference(w, bank, src, dst)
    gpu.service.serve()
    assert gpu.copies == 6 and [count for count, *_ in gpu.batches] == [4, 2]
    for pool, w in zip(pools, want):
        assert torch.equal(pool, w)
    with pytest.raises(AssertionError, match="bytes apart"):
        gpu.service.target((torch.zeros(E, 6, 4), torch.zeros(E, 4, 3)))


def test_serve_returns_at_once_when_nothing_is_posted() -> None:
    gpu, pools, *_ = make(lambda banks: [])
    before = gpu.service.host_timings
    gpu.service.serve()
    assert gpu.service.served == 0 and gpu.queries == 1 and gpu.copies == 0
    assert gpu.service.host_timings == (0, 0, 0, 1)
    assert gpu.service.host_timings.since(before) == {
        "lists": 0,
        "first_copy_queued_us": None,
        "all_queued_us": None,
        "queries_per_list": None,
    }


@pytest.mark.parametrize("batched", [False, True])
def test_a_failed_copy_raises_and_still_releases_the_waiters(batched: bool) -> None:
    gpu, pools, banks, counters = make(
        lambda banks: [(torch.tensor([2, 5]), torch.tensor([0, 1]), banks[0])], fail_copy_at=1, batched=batched
    )
    with pytest.raises(EdgeMoEError, match="CUDA error 700"):
        gpu.service.serve()
    assert counters[:2].tolist() == [CHUNKS, CHUNKS]  # the GPU would not hang on them
    assert gpu.service.served == 1


def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The next `library()` builds again, into `tmp_path`."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    copy_service.library.cache_clear()  # (the tests clear it again when done, so later ones build the real one)


def test_a_missing_c_compiler_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    fresh_build(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    try:
        with pytest.raises(EdgeMoEError, match="the copy service needs a C compiler"):
            make(lambda banks: [])
    finally:
        copy_service.library.cache_clear()


def test_a_failed_build_names_the_compiler_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    fresh_build(monkeypatch, tmp_path)
    broken = tmp_path / "copy_service.c"
    broken.write_text("int edgemoe_copy_service_serve(void) { return }\n")
    monkeypatch.setattr(copy_service, "SOURCE", broken)
    try:
        with pytest.raises(EdgeMoEError, match="building the copy service failed: .*error"):
            make(lambda banks: [])
    finally:
        copy_service.library.cache_clear()
