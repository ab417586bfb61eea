"""PLE backends on the CPU, module by module: `host` and `disk` rows bitwise equal to the `gpu` backend's (the oracle),
for the runner's path (`before_step`, then `rows`) and for calls without it; the disk backend reads each distinct id of
a step once, into a staging buffer of `max_tokens` rows, larger calls in pieces; ids out of range are refused; `wait`
sync falls back to `host` off CUDA with one log line. The wait's host side (`ReleaseWorker`): one release per replay,
a failed fill still releases and is reported in one line, a stalled fill is released by the watchdog and reported,
and a worker that failed refuses further replays. Graphs whose replay hooks need an upload say so."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edgemoe.engine.cuda_graphs import HookedGraph
from edgemoe.errors import EdgeMoEError
from edgemoe.layers import ple_disk
from edgemoe.layers.ple import HostPerLayerEmbeddings, PerLayerEmbeddings
from edgemoe.layers.ple_disk import DiskPerLayerEmbeddings, raw_dtype
from edgemoe.layers.ple_wait import ReleaseWorker

VOCAB, LAYERS, DIM = 50, 3, 4
CPU = torch.device("cpu")


def gpu_backend(dtype: torch.dtype = torch.float32) -> PerLayerEmbeddings:
    gpu = PerLayerEmbeddings(VOCAB, LAYERS, DIM).to(dtype)
    with torch.no_grad():
        gpu.weight.copy_(torch.randn(VOCAB, LAYERS * DIM, generator=torch.Generator().manual_seed(0)))
    return gpu


def disk_backend(gpu: PerLayerEmbeddings, max_tokens: int = 8, sync: str = "host") -> DiskPerLayerEmbeddings:
    """A disk backend over the gpu backend's table, as a raw array (the loader attaches a memory map of a file)."""
    disk = DiskPerLayerEmbeddings(VOCAB, LAYERS, DIM, max_tokens, gpu.weight.dtype, CPU, sync)
    disk.attach(gpu.weight.detach().view(torch.int16 if gpu.weight.dtype == torch.bfloat16 else torch.int32).numpy())
    return disk


IDS = [7, 3, 7, 49, 0, 3, 7]  # repeats, unordered, both ends of the vocabulary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_host_rows_equal_gpu_rows(dtype: torch.dtype) -> None:
    gpu = gpu_backend(dtype)
    host = HostPerLayerEmbeddings(gpu.weight.detach().clone(), LAYERS, DIM)
    ids = torch.tensor(IDS)
    assert torch.equal(host.rows(ids), gpu.rows(ids)) and host.rows(ids).shape == (len(IDS), LAYERS, DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_disk_rows_equal_gpu_rows_reading_each_distinct_id_once(dtype: torch.dtype) -> None:
    gpu = gpu_backend(dtype)
    disk = disk_backend(gpu)
    ids = torch.tensor(IDS)
    disk.before_step(IDS)  # the runner's path: staged before the step
    assert disk.rows_read == 4  # 7, 3, 49, 0
    assert torch.equal(disk.rows(ids), gpu.rows(ids))
    assert disk.rows_read == 4, "the step's rows were read again"
    assert torch.equal(disk.rows(torch.tensor([9, 9])), gpu.rows(torch.tensor([9, 9])))  # no before_step: ids read
    assert disk.rows_read == 5
    assert disk.staging.shape == (8, LAYERS * DIM), "the staging buffer holds max_tokens rows, not the table"


def test_disk_serves_larger_calls_in_pieces() -> None:
    gpu = gpu_backend()
    disk = disk_backend(gpu, max_tokens=3)
    ids = torch.tensor(IDS * 2)  # 14 tokens, 5 pieces of at most 3
    disk.before_step(IDS * 2)  # more than a runner's step: left to `rows`
    assert torch.equal(disk.rows(ids), gpu.rows(ids))


def test_disk_reads_on_threads_when_a_step_has_many_rows(monkeypatch) -> None:
    monkeypatch.setattr(ple_disk, "ROWS_PER_READER", 8)
    gpu = gpu_backend()
    disk = disk_backend(gpu, max_tokens=VOCAB)
    ids = list(range(VOCAB - 1, -1, -1))  # 50 distinct rows: 4 threads of 12 or 13
    disk.before_step(ids)
    assert disk._readers is not None
    assert torch.equal(disk.rows(torch.tensor(ids)), gpu.rows(torch.tensor(ids)))


def test_disk_refuses_ids_outside_the_table() -> None:
    disk = disk_backend(gpu_backend())
    with pytest.raises(EdgeMoEError, match=r"token ids must be in \[0, 50\)"):
        disk.before_step([3, VOCAB])


def test_raw_dtype_has_the_size_of_the_dtype() -> None:
    assert [raw_dtype(d).itemsize for d in (torch.float32, torch.bfloat16, torch.float16)] == [4, 2, 2]
    assert raw_dtype(torch.bfloat16) == np.int16


def test_wait_sync_on_cpu_falls_back_to_host_with_one_log_line(capsys) -> None:
    gpu = gpu_backend()
    disk = disk_backend(gpu, sync="wait")
    lines = capsys.readouterr().err.splitlines()
    assert disk.wait is None and disk.captured_waits == 0
    assert lines == ["edgemoe: ple_sync wait: it needs CUDA; syncing on the host instead (fill, then launch)"]
    disk.before_step(IDS)
    assert torch.equal(disk.rows(torch.tensor(IDS)), gpu.rows(torch.tensor(IDS)))


class Flag:
    """A stand-in for the pinned flag: counts releases."""

    def __init__(self) -> None:
        self.writes = 0

    def release(self) -> None:
        self.writes += 1


def test_release_worker_releases_once_per_replay_after_the_fill() -> None:
    flag, filled = Flag(), []
    worker = ReleaseWorker(lambda: filled.append(flag.writes), flag.release, timeout=5.0)
    for step in range(3):
        worker.before_replay()
        worker.after_replay()
        assert flag.writes == step + 1
    assert filled == [0, 1, 2], "each release comes after its fill"
    assert worker.needs_upload and worker.replays == 3


def test_a_failed_fill_still_releases_and_is_one_line() -> None:
    flag = Flag()

    def fill() -> None:
        raise OSError("Input/output error\nsecond line")

    worker = ReleaseWorker(fill, flag.release, timeout=5.0)
    worker.before_replay()
    with pytest.raises(EdgeMoEError) as err:
        worker.after_replay()
    assert flag.writes == 1
    assert str(err.value) == "staging per-layer embedding rows failed: OSError: Input/output error"
    with pytest.raises(EdgeMoEError, match="cannot decode further"):
        worker.before_replay()


def test_a_stalled_fill_is_released_by_the_watchdog() -> None:
    """Only the watchdog says "not staged within": had it not fired, the wait would end at the worker's own bound with
    another message. No upper bound on the time, which a busy machine stretches; a timeout never fires early."""
    flag, unblock = Flag(), threading.Event()
    worker = ReleaseWorker(lambda: unblock.wait(60), flag.release, timeout=0.2)
    start = time.monotonic()
    worker.before_replay()
    with pytest.raises(EdgeMoEError, match=r"not staged within 0.2 s"):
        worker.after_replay()
    assert time.monotonic() - start >= 0.2 and flag.writes == 1 and not unblock.is_set()
    unblock.set()  # the stalled fill ends late: it must not release a second time
    filler_done = threading.Event()
    worker._fills.put(filler_done.set)  # the filler thread runs its jobs in order: this one once the fill has ended
    assert filler_done.wait(60)
    assert flag.writes == 1


def test_graphs_need_upload_where_a_replay_hook_says_so() -> None:
    plain, waiting = SimpleNamespace(), SimpleNamespace(needs_upload=True)
    needs = HookedGraph.needs_upload.fget
    assert not needs(SimpleNamespace(hooks=(plain,))) and needs(SimpleNamespace(hooks=(plain, waiting)))
