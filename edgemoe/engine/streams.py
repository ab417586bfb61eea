"""The CUDA runtime calls torch does not wrap, through `cuda.bindings`: the side stream and graph upload.

The side stream is made by `cudaStreamCreateWithPriority(cudaStreamNonBlocking, highest)` and wrapped in a
`torch.cuda.ExternalStream`. Not `torch.cuda.Stream()`: torch hands those out from a small round-robin pool, so
one can alias the stream a graph capture runs on, and the fork/join would then order nothing. Non-blocking: it
never waits for the legacy default stream. Highest priority: the shared expert's few blocks are scheduled ahead
of the thousands of queued blocks of the miss copy running beside it (otherwise they would wait for the copy's
grid to drain and nothing would overlap).
"""

from __future__ import annotations

import functools

import torch


def _check(result: tuple) -> tuple:
    from cuda.bindings import runtime

    err, *rest = result
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime call failed: {runtime.cudaGetErrorString(err)[1].decode()}")
    return tuple(rest)


@functools.cache
def side_stream(device_index: int) -> torch.cuda.ExternalStream:
    """One side stream per device for the whole process (kept alive: captured graphs refer to it)."""
    from cuda.bindings import runtime

    with torch.cuda.device(device_index):
        _, highest = _check(runtime.cudaDeviceGetStreamPriorityRange())
        (handle,) = _check(runtime.cudaStreamCreateWithPriority(runtime.cudaStreamNonBlocking, highest))
    return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", device_index))


def upload_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """`cudaGraphUpload` of a captured graph on `stream`: its first launch then does not upload."""
    from cuda.bindings import runtime

    _check(runtime.cudaGraphUpload(graph.raw_cuda_graph_exec(), stream.cuda_stream))
