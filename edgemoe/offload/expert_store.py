"""The expert store: every routed expert of a model in one file on disk, in the rows the host banks would hold, for
the RAM tier (`edgemoe.offload.ram_tier`) to read the experts that do not fit the RAM budget, where the checkpoint's
own files cannot be read in place (`edgemoe.offload.in_place`), or `--expert-store` asks for a copy.

Layout: a 4 KiB header (a magic line, then JSON: the geometry, each layer's expert format and the checkpoint's
identity), then expert (moe layer l, expert e) at `HEADER_BYTES + (l * experts + e) * stride`, `stride` the row's
bytes rounded up to 4 KiB, so that every read is aligned for O_DIRECT.

The store is written once, by the loader itself: the host banks it fills are views of the file mapped in memory
(`ExpertStore.banks`), so a checkpoint's experts (or random ones) go to disk through the page cache, never all in RAM
at once, whatever the checkpoint's format. It is written under a temporary name and renamed when complete; a store
whose header matches the checkpoint (files, sizes, modification times) and the layouts is reused, and the loader then
skips the experts (its targets are on the meta device). The store sits beside the checkpoint, else (a read-only
folder, random weights) under `CACHE_DIR`, unless `--expert-store` names a folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import sys
from pathlib import Path

import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.ram_tier import row_stride

CACHE_DIR = Path.home() / ".cache" / "edgemoe" / "experts"
HEADER_BYTES = 4096  # a multiple of the RAM tier's ALIGN, so that every row is aligned for O_DIRECT
MAGIC = b"edgemoe expert store\n"
VERSION = 1
GiB = 2**30


def layout_name(layout: ExpertLayout) -> str:
    """One layer's expert format as the header records it."""
    q = getattr(layout, "q_gate_up", None)
    own = str(layout.dtype).removeprefix("torch.") if q is None else f"{q.name}/{layout.q_down.name}"
    return f"{own}:{layout.row_bytes}"


def source_identity(files: list[Path]) -> list[list]:
    """A checkpoint's files as the header records them: a store is reused only while they are unchanged."""
    return [[f.name, (s := f.stat()).st_size, s.st_mtime_ns] for f in files]


class ExpertStore:
    """One model's store file (see the module docstring). `source`: what the experts come from (the checkpoint's
    `source_identity`, or a description of random weights); `layouts`: each MoE layer's, in order."""

    def __init__(self, folders: list[Path], experts: int, layouts: list[ExpertLayout], source: object) -> None:
        if not layouts:
            raise EdgeMoEError("the expert store needs offloaded MoE layers")
        self.experts, self.layers = experts, len(layouts)
        self.row_bytes = max(layout.row_bytes for layout in layouts)
        self.stride = row_stride(self.row_bytes)
        self.header = {
            "version": VERSION, "layers": self.layers, "experts": experts, "row_bytes": self.row_bytes,
            "stride": self.stride, "formats": [layout_name(layout) for layout in layouts], "source": source,
        }  # fmt: skip
        digest = hashlib.sha256(json.dumps(self.header, sort_keys=True).encode()).hexdigest()[:16]
        self.size = HEADER_BYTES + self.layers * experts * self.stride
        name = f"edgemoe-experts-{digest}.bin"
        self.path = next((f / name for f in folders if self._valid(f / name)), None)
        self.reused = self.path is not None
        self.name = "the expert store"  # as errors say it
        self._map: mmap.mmap | None = None
        self._tmp: Path | None = None
        if not self.reused:
            self.path, self._tmp = self._create(folders, name)
            others = sorted(p.name for p in self.path.parent.glob("edgemoe-experts-*.bin") if p.name != name)
            if others:  # not removed here: another configuration of the same folder may still use them
                print(f"edgemoe: writing the expert store {self.path}; other stores in that folder (delete them if no "
                      f"longer used): {', '.join(others)}", file=sys.stderr)  # fmt: skip

    @property
    def files(self) -> list[Path]:
        return [self.path]

    @property
    def where(self) -> str:
        return f"expert store {self.path}"

    def segments(self) -> torch.Tensor:
        """The RAM tier's table (`edgemoe.offload.ram_tier.TierSource`): each row one segment, whole and aligned."""
        keys = torch.arange(self.layers * self.experts, dtype=torch.int64)
        out = torch.zeros(keys.numel(), 1, 4, dtype=torch.int64)  # [keys, 1, (file, offset, bytes, at)]
        out[:, 0, 1] = HEADER_BYTES + keys * self.stride
        out[:, 0, 2] = self.stride
        return out

    def _valid(self, path: Path) -> bool:
        """Whether `path` is a complete store of these experts (its header and size)."""
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return False
        if not head.startswith(MAGIC) or size != self.size:
            return False
        try:
            return json.loads(head[len(MAGIC) :].rstrip(b" \0")) == self.header
        except ValueError:
            return False

    def _create(self, folders: list[Path], name: str) -> tuple[Path, Path]:
        """A temporary file of the store's size in the first of `folders` that takes it: (final path, temporary)."""
        reasons = []
        for folder in folders:
            path = folder / name
            tmp = path.with_name(f"{name}.{os.getpid()}.tmp")
            try:
                folder.mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(folder).free
                if free < self.size:
                    reasons.append(f"{folder} has {free / GiB:.1f} GiB free")
                    continue
                with open(tmp, "wb") as f:
                    f.truncate(self.size)
                    with contextlib.suppress(OSError):  # reserve the blocks where the file system can
                        os.posix_fallocate(f.fileno(), 0, self.size)
                return path, tmp
            except OSError as exc:  # a read-only folder (then the next), a full disk
                reasons.append(f"cannot write {folder}: {exc.strerror or exc}")
                with contextlib.suppress(OSError):
                    tmp.unlink()
        raise EdgeMoEError(f"the expert store needs {self.size / GiB:.2f} GiB on disk: {'; '.join(reasons)}")

    def banks(self, layout: ExpertLayout, layer: int) -> torch.Tensor:
        """MoE layer `layer`'s bank [experts, row] for the loader to fill: a view of the mapped file, or (a reused
        store) a tensor on the meta device, which takes the loader's copies without doing them."""
        if self.reused:
            return torch.empty(self.experts, layout.row, dtype=layout.dtype, device="meta")
        if self._map is None:
            with open(self._tmp, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), self.size)
            self._map.madvise(mmap.MADV_SEQUENTIAL)
        per = self.stride // layout.dtype.itemsize
        data = torch.frombuffer(self._map, dtype=layout.dtype, count=self.experts * per,
                                offset=HEADER_BYTES + layer * self.experts * self.stride)  # fmt: skip
        return data.view(self.experts, per)[:, : layout.row]

    def finish(self) -> None:
        """The loader is done: the header written, the file flushed, renamed into place and dropped from the page
        cache (the RAM tier reads it without it). Nothing for a reused store."""
        if self.reused or self._tmp is None:
            return
        try:
            if self._map is not None:
                self._map.flush()
                self._map = None  # unmapped once the last bank viewing it is gone
            with open(self._tmp, "r+b") as f:
                f.write((MAGIC + json.dumps(self.header).encode()).ljust(HEADER_BYTES, b" "))
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.replace(self._tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            raise EdgeMoEError(f"cannot write the expert store {self.path}: {exc.strerror or exc}") from None
        self._tmp = None

    def discard(self) -> None:
        """Loading failed: the unfinished file goes."""
        self._map = None  # unmapped once the last bank viewing it is gone
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._tmp = None
