"""The RAM tier: host rows (pinned on CUDA) caching experts read from disk, for models whose experts do not fit the
RAM budget (`--ram-budget`). Three tiers then: the device's slot pool (the expert cache), these rows, and the files
the rows are read from: the expert store (`edgemoe.offload.expert_store`), or the checkpoint's own files where they
hold each expert's weights as the rows do (`edgemoe.offload.in_place`).

Either source says where each expert lies as a table of segments, (file, offset, bytes, offset in the row) a piece
(`TierSource.segments`): one a row for the store, one a weight for a GGUF read in place. A miss of the device cache is
copied from a RAM row, read first from those files where the RAM tier misses too (`ram_tier.c`: least recently used
rows evicted, each call's reads in flight at once on a pool of reader threads, with O_DIRECT). Replayed decode graphs
reach it through the copy service's serve loop, which fetches each posted list's experts before it queues their copies
(`CopyService.attach_tier`); an eager step (prefill waves, eager decode, the CPU device) reads its copy list on the
host (a sync) and copies the rows itself (`copy_missing`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref
from pathlib import Path
from typing import Protocol

import torch

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.kernels.protocol import Ensured
from edgemoe.offload.c_library import build_library

SOURCE = Path(__file__).with_name("ram_tier.c")
READERS = 8  # reads in flight at once: one an expert, each split by the kernel into requests of the drive's size
STATS = ("accesses", "hits", "reads", "bytes_read", "read_ns", "direct", "error")
ALIGN = 4096  # O_DIRECT's: offsets, lengths and buffers
SEGMENT = ("file", "offset", "bytes", "at")  # a segment's fields; file -1: `bytes` zeros at `at` in the row


def row_stride(row_bytes: int) -> int:
    """Bytes from one RAM row to the next (and one stored expert to the next): the row rounded up to `ALIGN`."""
    return -(-row_bytes // ALIGN) * ALIGN


class TierSource(Protocol):
    """Where the RAM tier reads experts from: `layers` x `experts` rows of `row_bytes`, `stride` apart in RAM (a
    multiple of `ALIGN`), held by `files`; `name` says it in errors, `where` in the start-up line."""

    files: list[Path]
    layers: int
    experts: int
    row_bytes: int
    stride: int
    name: str
    where: str

    def segments(self) -> torch.Tensor:
        """int64 [layers * experts, per row, len(SEGMENT)]: where each expert's row comes from, piece by piece
        (expert (l, e) at l * experts + e; pieces of 0 bytes skipped)."""
        ...


@functools.cache
def library() -> ctypes.CDLL:
    lib = build_library(SOURCE, "ram-tier", "the RAM tier of the experts", ["-O2", "-pthread"])
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.edgemoe_ram_tier_open.argtypes = [ctypes.POINTER(ctypes.c_char_p), i64, p, i64, i64, i64, i64, i64, p, i64,
                                          ctypes.c_int, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    lib.edgemoe_ram_tier_open.restype = p
    lib.edgemoe_ram_tier_close.argtypes, lib.edgemoe_ram_tier_close.restype = [p], None
    lib.edgemoe_ram_tier_fetch.argtypes = [p, i64, p, i64, p]
    lib.edgemoe_ram_tier_stats.argtypes, lib.edgemoe_ram_tier_stats.restype = [p, p], None
    lib.edgemoe_ram_tier_reset.argtypes, lib.edgemoe_ram_tier_reset.restype = [p], None
    lib.edgemoe_ram_tier_row.argtypes, lib.edgemoe_ram_tier_row.restype = [p, i64, i64], i64
    return lib


def pin_in_place(t: torch.Tensor, what: str) -> None:
    """Page-lock `t`'s memory where it lies (cudaHostRegister, portable and mapped), unlocked when `t` is collected."""
    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, size, 3)
    if int(err) != 0:
        raise EdgeMoEError(f"cannot pin {size / 2**30:.2f} GiB of host memory for {what} (CUDA error {int(err)})")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)


def check_rows(rows: int, stride: int, cfg: ModelConfig, seqs: int, budget: object) -> None:
    """One line where `rows` RAM rows cannot hold one layer's experts of a decode step of `seqs` sequences."""
    need = min(cfg.num_experts, cfg.top_k * seqs)
    if rows < need:
        raise EdgeMoEError(
            f"ram_budget {budget} holds {rows} experts ({stride / 2**20:.2f} MiB each); a decode step of {seqs} "
            f"sequence{'s' if seqs > 1 else ''} needs up to {need} of one layer in RAM (top_k {cfg.top_k}): raise "
            f"ram_budget{' or lower max_num_seqs' if seqs > 1 else ''}"
        )


class RamTier:
    """`rows` host rows over `source` (see the module docstring); `pin`: page-locked, for the copy engine."""

    def __init__(self, source: TierSource, rows: int, pin: bool, readers: int = READERS) -> None:
        if rows < 1:
            raise EdgeMoEError("the RAM tier needs at least one row")
        self.source, self.rows, self.stride, self.row_bytes = source, rows, source.stride, source.row_bytes
        self.layers, self.experts = source.layers, source.experts
        self._map = mmap.mmap(-1, rows * source.stride)  # page-aligned, as O_DIRECT needs
        self.pool = torch.frombuffer(self._map, dtype=torch.uint8).view(rows, source.stride)  # [rows, stride]
        if pin:
            pin_in_place(self.pool, "the RAM tier of the experts")
        segments = source.segments().to(torch.int64).contiguous()  # [layers * experts, per row, 4]
        assert segments.shape[0] == source.layers * source.experts and segments.shape[2] == len(SEGMENT)
        paths = (ctypes.c_char_p * len(source.files))(*(str(f).encode() for f in source.files))
        err = ctypes.c_int(0)
        self.handle = library().edgemoe_ram_tier_open(
            paths, len(source.files), segments.data_ptr(), segments.shape[1], source.layers, source.experts,
            source.row_bytes, source.stride, self.pool.data_ptr(), rows, readers, ctypes.byref(err),
        )  # fmt: skip
        if not self.handle:
            raise EdgeMoEError(f"cannot open {source.name} for the RAM tier: {os.strerror(err.value)}")
        self._finalizer = weakref.finalize(self, library().edgemoe_ram_tier_close, self.handle)
        assert self.pool.data_ptr() % ALIGN == 0

    def failure(self, code: int) -> str:
        """The one line for error `code` (an errno) of a fetch."""
        name = self.source.name
        if code == 116:  # ESTALE
            why = f"{name} changed on disk since it was opened"
        elif code == 5:  # EIO: also a read that came back short
            why = f"a read of {name} failed or came back short (the file truncated?)"
        else:
            why = os.strerror(code)
        return f"the RAM tier of the experts failed: {why}"

    @property
    def c_entry(self) -> tuple[int, int]:
        """(address of `int edgemoe_ram_tier_fetch(tier, layer, const int64_t *experts, n, uint64_t *addrs)`, the
        tier) for the copy service's serve loop."""
        return ctypes.cast(library().edgemoe_ram_tier_fetch, ctypes.c_void_p).value, self.handle

    def fetch(self, layer: int, experts: torch.Tensor) -> torch.Tensor:
        """MoE layer `layer`'s `experts` (int64 [n] on the host, distinct) resident in RAM -> their rows [n]."""
        experts = experts.to(torch.int64).contiguous()
        addrs = torch.empty(experts.numel(), dtype=torch.int64)
        code = library().edgemoe_ram_tier_fetch(self.handle, layer, experts.data_ptr(), experts.numel(),
                                                addrs.data_ptr())  # fmt: skip
        if code:
            raise EdgeMoEError(self.failure(code))
        return (addrs - self.pool.data_ptr()) // self.stride

    def copy_missing(self, copy: Ensured, layer: int, joined: torch.Tensor, counters: tuple | None) -> None:
        """An eager step's copy list into the slot pool `joined` [S + 1, row]: its length and experts read on the host
        (a sync), the experts fetched, their rows copied; `counters` (arrival counters, chunks an entry) marked for
        the expert kernels that wait on them."""
        listed = torch.cat([copy.count.view(1), copy.src]).cpu()  # one sync: the length and the experts
        n = int(listed[0])
        if n == 0:
            return
        rows = self.fetch(layer, listed[1 : 1 + n])
        pool = joined.view(torch.uint8)  # [S + 1, row bytes]
        data = self.pool[rows, : pool.shape[1]]  # [n, row bytes]: a copy, so the rows may be reused at once
        pool.index_copy_(0, copy.dst[:n], data.to(pool.device, non_blocking=False))
        if counters is not None:
            counters[0][:n] = counters[1]

    def stats(self) -> dict:
        """The tier's counters since the start or the last `reset`: accesses, hits, reads (each an expert from disk),
        bytes and seconds reading, whether reads bypass the page cache (O_DIRECT); the hit rate and read bandwidth."""
        out = torch.zeros(len(STATS), dtype=torch.int64)
        library().edgemoe_ram_tier_stats(self.handle, out.data_ptr())
        got = dict(zip(STATS, out.tolist()))
        got["direct"] = bool(got["direct"])
        got["hit_rate"] = got["hits"] / got["accesses"] if got["accesses"] else 0.0
        got["read_GBps"] = got["bytes_read"] / got["read_ns"] if got["read_ns"] else None
        return {"rows": self.rows, **got}

    def reset(self) -> None:
        """Forget every resident expert and the counters (the rows stay)."""
        library().edgemoe_ram_tier_reset(self.handle)

    def row_of(self, layer: int, expert: int) -> int:
        """The RAM row holding (layer, expert), -1 if none."""
        return library().edgemoe_ram_tier_row(self.handle, layer, expert)

    def close(self) -> None:
        self._finalizer()


def read_bandwidth(source: TierSource, per_call: int, budget: int = 2**31, seed: int = 0) -> dict:
    """The drive's read rate as the tier reads: calls of `per_call` distinct random experts of one random layer (a
    decode step's misses of a layer), about `budget` bytes in all, through a fresh tier (O_DIRECT where the file system
    allows it, so cold: not from the page cache)."""
    gen = torch.Generator().manual_seed(seed)
    per_call = min(per_call, source.experts)
    calls = max(1, min(source.layers * source.experts, budget // source.stride) // per_call)
    tier = RamTier(source, per_call, pin=False)
    try:
        for _ in range(calls):
            layer = int(torch.randint(source.layers, (), generator=gen))
            tier.fetch(layer, torch.randperm(source.experts, generator=gen)[:per_call])
        got = tier.stats()
    finally:
        tier.close()
    return {"disk_bytes_per_s": got["bytes_read"] / got["read_ns"] * 1e9, "disk_direct": got["direct"],
            "disk_reads_per_call": got["reads"] / calls}  # fmt: skip
