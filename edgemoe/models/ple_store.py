"""Where the loader puts per-layer embeddings (`--ple-backend`).

The family builds the `gpu` module (`edgemoe.layers.ple.PerLayerEmbeddings`); `place_ple` swaps it, before any storage
is allocated, for the `host` backend (a host table the loader fills as it fills expert banks) or the `disk` backend,
whose table the loader never reads: it hands the checkpoint file holding the tensor to `open_table`, which maps the
tensor in place where the checkpoint stores it in the run's dtype (a safetensors tensor is always contiguous and
row-major, so only the dtype can differ), else converts it once into a file beside the checkpoint (or under
`CACHE_DIR` where the checkpoint's folder is not writable), streamed in chunks behind a progress bar, and checks that
file's header and size whenever it is reused.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.layers.ple import HostPerLayerEmbeddings, PerLayerEmbeddings, PLEOptions
from edgemoe.layers.ple_disk import DiskPerLayerEmbeddings, raw_dtype
from edgemoe.models.decoder import MoEForCausalLM

CACHE_DIR = Path.home() / ".cache" / "edgemoe" / "ple"  # converted tables of checkpoints in read-only folders
HEADER_BYTES = 4096  # a converted file's header, padded so that its rows start page-aligned
MAGIC = b"edgemoe per-layer embeddings\n"
CHUNK_BYTES = 64 << 20  # checkpoint rows converted at a time: the conversion's host memory
_SAFETENSORS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# (checkpoint file, tensor name in it) -> None: a tensor its backend reads itself (`load_weights` skips it)
Reader = Callable[[Path, str], None]


def place_ple(
    model: MoEForCausalLM, ple: PLEOptions, device: torch.device, dtype: torch.dtype, progress: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Reader]]:
    """Swap the model's `gpu` per-layer embeddings (still on the meta device) for `ple.backend`'s. -> (host tables
    by parameter name: the loader fills them, readers by parameter name: tensors a backend reads itself)."""
    if ple.backend == "gpu":
        return {}, {}
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, PerLayerEmbeddings)]
    if not found:
        raise EdgeMoEError(f"ple_backend {ple.backend}: {model.config.model_type} models have no per-layer embeddings")
    targets, readers = {}, {}
    for name, gpu in found:
        vocab, layers, dim = gpu.weight.shape[0], gpu.layers, gpu.dim
        if ple.backend == "host":
            from edgemoe.offload.banks import allocate_bank

            table = allocate_bank((vocab, layers * dim), dtype, device.type == "cuda", "the per-layer embeddings")
            new = HostPerLayerEmbeddings(table, layers, dim)
            targets[f"{name}.weight"] = table
        else:
            new = DiskPerLayerEmbeddings(vocab, layers, dim, ple.max_tokens, dtype, device, ple.sync)
            readers[f"{name}.weight"] = functools.partial(_attach, new, dtype, progress)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    return targets, readers


def _attach(module: DiskPerLayerEmbeddings, dtype: torch.dtype, progress: bool, file: Path, key: str) -> None:
    module.attach(open_table(file, key, module.vocab, module.layers, module.dim, dtype, progress))


def open_table(
    file: Path, key: str, vocab: int, layers: int, dim: int, dtype: torch.dtype, progress: bool = True
) -> np.memmap:
    """Tensor `key` of safetensors `file` as a read-only memory map [vocab, layers * dim] of `raw_dtype(dtype)`: in
    place where the checkpoint stores it in `dtype`, else the converted file (written first if there is none)."""
    entry, data = _header_entry(file, key)
    shape, size = [vocab, layers * dim], file.stat().st_size
    if entry.get("shape") != shape:
        raise EdgeMoEError(f"tensor {key} in {file} has shape {entry.get('shape')}, the config implies {shape}")
    begin, end = entry["data_offsets"]
    if size < data + end:
        raise EdgeMoEError(f"{file} is short: {key} ends at byte {data + end}, the file has {size} (cut off?)")
    if _SAFETENSORS.get(entry["dtype"]) == dtype:
        return np.memmap(file, dtype=raw_dtype(dtype), mode="r", offset=data + begin, shape=(vocab, layers * dim))
    source = {"source_file": file.name, "source_tensor": key, "source_dtype": entry["dtype"], "source_bytes": size}
    expected = {"vocab": vocab, "layers": layers, "dim": dim, "dtype": str(dtype).removeprefix("torch."), **source}
    places = _places(file, key, dtype)
    path = next((p for p in places if p.is_file()), None) or _convert(file, key, expected, dtype, places, progress)
    _validate(path, expected, dtype)
    return np.memmap(path, dtype=raw_dtype(dtype), mode="r", offset=HEADER_BYTES, shape=(vocab, layers * dim))


def _header_entry(file: Path, key: str) -> tuple[dict, int]:
    """(`key`'s entry in the safetensors header of `file`, the byte where the file's data begins)."""
    header, n = None, -1
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            n = int.from_bytes(head, "little")
            try:
                header = json.loads(f.read(n))
            except (ValueError, MemoryError):
                header = None
    if not isinstance(header, dict) or not isinstance(header.get(key), dict):
        raise EdgeMoEError(f"cannot read tensor {key} from {file}: its safetensors header is missing or cut off")
    return header[key], 8 + n


def _places(file: Path, key: str, dtype: torch.dtype) -> list[Path]:
    """Where the converted table of `file`'s `key` may be: beside the checkpoint, else in the cache directory (under
    a digest of the checkpoint's path)."""
    name = f"{key}.{str(dtype).removeprefix('torch.')}.ple"
    digest = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:16]
    return [file.parent / name, CACHE_DIR / digest / name]


def _convert(file: Path, key: str, expected: dict, dtype: torch.dtype, places: list[Path], progress: bool) -> Path:
    """Write the converted table at the first of `places` that takes it (a temporary file renamed when complete, so
    an interrupted conversion leaves nothing that looks reusable). -> its path."""
    reason = ""
    for path in places:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as out:
                _write_rows(out, file, key, expected, dtype, progress)
            os.replace(tmp, path)
            return path
        except OSError as exc:  # a read-only folder (then the cache directory), a full disk
            reason = f"cannot write {path}: {exc.strerror or exc}"
            with contextlib.suppress(OSError):  # what was written of it (or whatever stood in its way) stays
                tmp.unlink()
    raise EdgeMoEError(reason)


def _write_rows(out, file: Path, key: str, expected: dict, dtype: torch.dtype, progress: bool) -> None:  # noqa: ANN001
    """The header, then the checkpoint's rows converted to `dtype` a chunk at a time (`out`: a binary file)."""
    out.write((MAGIC + json.dumps(expected).encode()).ljust(HEADER_BYTES, b" "))
    vocab, width = expected["vocab"], expected["layers"] * expected["dim"]
    rows = max(1, CHUNK_BYTES // (width * 8))  # 8: the widest element of a chunk (a float64 source)
    with safe_open(str(file), framework="pt") as handle:
        part = handle.get_slice(key)
        desc = f"writing {key} as {expected['dtype']}"
        with tqdm(total=vocab, desc=desc, unit="row", unit_scale=True, disable=not progress or None) as bar:
            for start in range(0, vocab, rows):
                chunk = part[start : start + rows].to(dtype).contiguous()  # [rows, layers * dim]
                out.write(chunk.view(torch.uint8).numpy().data)
                bar.update(chunk.shape[0])


def _describe(h: dict) -> str:
    return (
        f"vocab {h.get('vocab')}, {h.get('layers')} layers of {h.get('dim')} in {h.get('dtype')}, from "
        f"{h.get('source_tensor')} ({h.get('source_dtype')}) of {h.get('source_file')} ({h.get('source_bytes')} bytes)"
    )


def _validate(path: Path, expected: dict, dtype: torch.dtype) -> None:
    """The converted file's header names this table and its size holds every row, else one line naming it."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        found = json.loads(head[len(MAGIC) :]) if head.startswith(MAGIC) else None
    except (OSError, ValueError):
        found = None
    redo = "delete it to have it written again"
    if not isinstance(found, dict):
        raise EdgeMoEError(f"{path} is not a per-layer embedding table edgemoe wrote: {redo}")
    if found != expected:
        raise EdgeMoEError(f"{path} holds {_describe(found)}; this model needs {_describe(expected)}: {redo}")
    size = path.stat().st_size
    want = HEADER_BYTES + expected["vocab"] * expected["layers"] * expected["dim"] * dtype.itemsize
    if size != want:
        what = "short" if size < want else "too long"
        raise EdgeMoEError(f"{path} is {what}: {size} bytes where its table takes {want}: {redo}")
