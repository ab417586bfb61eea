"""The copy service's host thread (`edgemoe/moe/copy_service.c`, built with the system's C compiler) on the CPU: the
CUDA driver entry points it calls are replaced by ctypes callbacks over host memory (a memmove for
`cuMemcpyHtoDAsync`, a plain store for `cuStreamWriteValue64`), and the GPU's post kernel by `post`, which writes
a mailbox row as `edgemoe.kernels.miss_copy.post_copy_list` does. Checked against `copy_rows_reference`: every
listed row lands in its slot, each entry's counter is set once its rows are in, lists are served in order across
the ring of mailbox rows, and a failing copy is reported while the waiters are still released."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.moe.copy_service import RING, CopyService
from edgemoe.moe.expert_cache import copy_rows_reference

E, S, CHUNKS = 10, 6, 7
COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
WRITE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class HostDriver:
    """Driver entry points over host memory; `fail_copy_at`: the copy call (0-based) that returns error 700."""

    def __init__(self, fail_copy_at: int = -1) -> None:
        self.copies, self.writes, self.fail_copy_at = 0, [], fail_copy_at
        self.context, self.stream = ctypes.c_void_p(1), ctypes.c_void_p(2)

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

        self._callbacks = COPY(copy), WRITE(write), CONTEXT(lambda context: 0)  # kept alive with the driver
        self.functions = [ctypes.cast(f, ctypes.c_void_p).value for f in self._callbacks]


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


def wait_served(service: CopyService, seq: int) -> None:
    deadline = time.monotonic() + 10
    while service.served < seq:
        assert time.monotonic() < deadline, f"list {seq} not served"
        time.sleep(1e-4)


def make(driver: HostDriver) -> tuple[CopyService, tuple[torch.Tensor, ...], list, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    banks = [(torch.randn(E, 6, 4, generator=gen), torch.randn(E, 4, 3, generator=gen)) for _ in range(3)]
    pools = torch.zeros(S + 1, 6, 4), torch.zeros(S + 1, 4, 3)
    counters = torch.zeros(E, dtype=torch.int64)
    return CopyService(pools, counters, CHUNKS, E, driver=driver), pools, banks, counters


def test_lists_are_served_in_order_into_their_slots() -> None:
    driver = HostDriver()
    service, pools, banks, counters = make(driver)
    want = tuple(p.clone() for p in pools)
    gen = torch.Generator().manual_seed(4)
    try:
        for step in range(3 * RING + 1):  # around the ring of mailbox rows several times
            layer, n = step % len(banks), 1 + step % 4
            src, dst = torch.randperm(E, generator=gen)[:n], torch.randperm(S, generator=gen)[:n]
            counters.zero_()  # as ensure does before each list
            driver.writes.clear()
            wait_served(service, post(service, src, dst, banks[layer]))
            for pool, w, bank in zip(pools, want, banks[layer]):
                copy_rows_reference(w, bank, src, dst)
                assert torch.equal(pool, w), step
            assert counters[:n].tolist() == [CHUNKS] * n and not counters[n:].any()
            assert [(a - counters.data_ptr()) // 8 for a, _, _ in driver.writes] == list(range(n))  # in entry order
        assert driver.copies == sum(2 * (1 + s % 4) for s in range(3 * RING + 1))  # two rows an entry
        service.check()
    finally:
        service.close()


def test_a_failed_copy_is_reported_and_releases_the_waiters() -> None:
    service, pools, banks, counters = make(HostDriver(fail_copy_at=1))
    try:
        wait_served(service, post(service, torch.tensor([2, 5]), torch.tensor([0, 1]), banks[0]))
        assert counters[:2].tolist() == [CHUNKS, CHUNKS]  # the GPU would not hang on them
        with pytest.raises(EdgeMoEError, match="CUDA error 700"):
            service.check()
    finally:
        service.close()


def test_close_stops_the_thread_and_is_idempotent() -> None:
    service, *_ = make(HostDriver())
    service.close()
    service.close()
    assert service._state.stop == 1
