"""The `disk` per-layer-embedding backend: the table stays in a memory-mapped file (the checkpoint's own tensor where
its layout allows, else a file written once beside it: `edgemoe.models.ple_store`), and each step's rows are read on
host threads into a fixed staging buffer `[max_tokens, layers * dim]` (pinned on CUDA), every distinct id of the
step once; the device then gathers the step's rows from the staging buffer by one staging slot per token (`slots`,
built on the host alongside, copied to the device with the step's inputs). Host RAM holds the staging buffer and the
file's page cache, never the table.

A step's ids must be on the host before it runs: the model runner hands them to `before_step`, for eager and replayed
steps alike. Host sync: `before_step` stages the rows, then the step runs. Wait sync (`edgemoe.layers.ple_wait`):
`before_step` only assigns the slots; a replayed graph waits on the GPU, just before the rows' first use, for a
thread that stages them; an eager step stages them in `gather` itself.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.layers.ple import PLEBackend, gather_rows_reference
from edgemoe.layers.ple_wait import make_wait_sync

READERS = 4  # threads that read one step's rows: page faults of a mapped file, each copy releasing the GIL
ROWS_PER_READER = 32  # fewer rows than twice this are read by one thread: a hand-off costs more than it saves
# numpy has no bfloat16: rows move as integers of their size
_INTS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


def raw_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy integer type of `dtype`'s size: how rows of `dtype` are read from a file and staged."""
    return np.dtype(_INTS[dtype.itemsize][1])


def _never() -> bool:
    return False


def _nothing() -> None:
    pass


def _stream_idle(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


class DiskPerLayerEmbeddings(PLEBackend):
    """The `disk` backend (see the module docstring). `max_tokens`: the most tokens a step computes (larger calls,
    from outside the runner, are served in pieces); `sync`: `host` or `wait`."""

    def __init__(
        self, vocab: int, layers: int, dim: int, max_tokens: int, dtype: torch.dtype, device: torch.device, sync: str
    ) -> None:
        super().__init__(layers, dim)
        self.vocab, self.max_tokens = vocab, max_tokens
        cuda = device.type == "cuda"
        self.staging = torch.zeros(max_tokens, layers * dim, dtype=dtype, pin_memory=cuda)  # [slots, layers * dim]
        self._staged = self.staging.view(_INTS[dtype.itemsize][0]).numpy()
        self._slots_host = torch.zeros(max_tokens, dtype=torch.long, pin_memory=cuda)
        self._slots_np = self._slots_host.numpy()
        # [max_tokens] each token's staging slot; stale entries past a step's tokens still name valid slots
        self.slots = torch.zeros(max_tokens, dtype=torch.long, device=device) if cuda else self._slots_host
        self.table: np.ndarray | None = None  # [vocab, layers * dim] as raw integers, memory-mapped (`attach`)
        self.rows_read = 0  # rows read from the file so far: each distinct id of a step once
        self._pending: np.ndarray | None = None  # distinct ids given slots whose rows are not staged yet
        self._staged_for: int | None = None  # tokens of the step `before_step` prepared (its next eager gather)
        self._gather = gather_rows_reference
        self._capturing = torch.cuda.is_current_stream_capturing if cuda else _never
        self._idle = functools.partial(_stream_idle, device) if cuda else _nothing
        self._readers: ThreadPoolExecutor | None = None
        self.wait = make_wait_sync(device, self._fill) if sync == "wait" else None  # None: host sync

    @property
    def captured_waits(self) -> int:
        """Graphs captured with a wait for this backend's rows (whose first launch must not block)."""
        return 0 if self.wait is None else self.wait.captured

    def attach(self, table: np.ndarray) -> None:
        """The memory-mapped table, [vocab, layers * dim] of `raw_dtype(dtype)`."""
        shape, width = (self.vocab, self.layers * self.dim), self._staged.dtype
        assert table.shape == shape and table.dtype == width, f"table {table.shape} {table.dtype}, not {shape} {width}"
        self.table = table

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.ple_gather import gather_rows

        self._gather = gather_rows

    def before_step(self, ids: list[int]) -> None:
        """The runner's pre-step hook: the step's token ids (host) before it runs, eager or replayed."""
        if self.wait is not None:
            self.wait.worker.check()
        self._staged_for = None
        if len(ids) > self.max_tokens:
            return  # not a runner's step size: `gather` reads it in pieces
        self._stage(ids)
        if self.wait is None:
            self._fill()
        self._staged_for = len(ids)

    def gather(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        if self._capturing():
            if self.wait is not None:
                self.wait.capture()  # the replay's rows are staged by a thread while the graph runs up to here
            return self._gather(self.staging, self.slots[:n])
        if n > self.max_tokens:
            return self._gather_in_pieces(input_ids.tolist())
        if self._staged_for != n:  # a call from outside the runner, without `before_step`: the ids from the device
            self._stage(input_ids.tolist())
        self._staged_for = None
        self._fill()  # wait sync stages an eager step's rows here; host sync did in `before_step`
        return self._gather(self.staging, self.slots[:n])

    def _gather_in_pieces(self, ids: list[int]) -> torch.Tensor:
        pieces = []
        for start in range(0, len(ids), self.max_tokens):
            part = ids[start : start + self.max_tokens]
            self._stage(part)
            self._fill()
            pieces.append(self._gather(self.staging, self.slots[: len(part)]))
        self._staged_for = None
        return torch.cat(pieces)

    def _stage(self, ids: list[int]) -> None:
        """Give each distinct id a staging slot (in id order, so the file is read front to back) and each token its
        id's slot; `_fill` reads the rows."""
        self._idle()  # the last step's gather may still read the staging buffer and the slots
        distinct, inverse = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
        if len(distinct) and not 0 <= distinct[0] <= distinct[-1] < self.vocab:
            raise EdgeMoEError(f"token ids must be in [0, {self.vocab}) for the per-layer embeddings")
        self._slots_np[: len(ids)] = inverse
        if self.slots is not self._slots_host:
            self.slots[: len(ids)].copy_(self._slots_host[: len(ids)], non_blocking=True)
        self._pending = distinct

    def _fill(self) -> None:
        """Read the rows of the ids `_stage` gave slots into the staging buffer (no-op if done)."""
        distinct, self._pending = self._pending, None
        if distinct is None:
            return
        if self.table is None:
            raise EdgeMoEError("the disk per-layer embeddings have no table: the loader attaches it")
        out, k = self._staged, len(distinct)
        if k < 2 * ROWS_PER_READER:
            np.take(self.table, distinct, axis=0, out=out[:k], mode="clip")  # clip: no buffered copy (ids checked)
        else:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="edgemoe-ple-read")
            edges = np.linspace(0, k, min(READERS, k // ROWS_PER_READER) + 1, dtype=np.int64)
            spans = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
            read = lambda a, b: np.take(self.table, distinct[a:b], axis=0, out=out[a:b], mode="clip")  # noqa: E731
            for done in [self._readers.submit(read, a, b) for a, b in spans]:
                done.result()
        self.rows_read += k
