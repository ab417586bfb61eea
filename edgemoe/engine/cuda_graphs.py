"""Decode CUDA graphs: one graph per batch size over a forward function of static buffers, replayed.

The graphs know nothing of their users. Work a captured step enqueues that needs the host at replay time (the copy
service serves the copy lists a step posts) joins the capture as a participant (`edgemoe.capture.participate`): the
graph runs its `ReplayHook` around every replay.

Upload: a graph is uploaded (`cudaGraphUpload` + sync) when it is captured only where its first launch must not
block: a replay hook whose `needs_upload` is true (a graph that waits on the GPU for work its replay hook hands to a
host thread). Others upload on their first replay. Uploading every graph, none, or replaying each once at capture
measured alike (docs/findings.md, "Graph upload policies make no difference"), so this is not a setting.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from edgemoe.capture import ReplayHook, recording

T = TypeVar("T")


class HookedGraph(torch.cuda.CUDAGraph):
    """A captured CUDA graph whose `replay` runs the replay hooks its capture registered (a decode step with offloaded
    experts waits on the GPU for the copies it posted, so a replay nobody served would never end)."""

    hooks: tuple[ReplayHook, ...] = ()
    uploaded = False  # uploaded at capture (`capture_graph`)

    @property
    def needs_upload(self) -> bool:
        """Whether a replay hook says the first launch must not block."""
        return any(getattr(hook, "needs_upload", False) for hook in self.hooks)

    def replay(self) -> None:
        for hook in self.hooks:
            hook.before_replay()
        super().replay()
        for hook in self.hooks:
            hook.after_replay()


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """A dead CUDA graph (say, of an engine left in a reference cycle) destroyed mid-capture invalidates the capture,
    and torch no longer collects when a capture begins: collect first, then keep the collector off."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def capture_graph(fn: Callable[[], T], pool: tuple | None = None, upload: bool | None = None) -> tuple[HookedGraph, T]:
    """`fn` once eagerly on a side stream (kernels compiled, allocator and caches warmed, so the captured work finds
    the state a replay will), then captured (into `pool` when given) and uploaded where its hooks say it
    `needs_upload` (`upload` True/False forces it: the GPU tests show what a first launch without one does).
    -> (graph, what the captured call returned: its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = HookedGraph()
    with _no_collection(), recording() as hooks:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    graph.hooks = tuple(hooks)
    if graph.needs_upload if upload is None else upload:
        from edgemoe.engine.streams import upload_graph

        upload_graph(graph, torch.cuda.current_stream())
        torch.cuda.synchronize()
        graph.uploaded = True
    return graph, out


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, and max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """One graph per batch size of `forward(b)`, a decode step over the first b rows of static buffers (the
    `ModelRunner`'s) returning logits; all graphs share one memory pool."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(set(sizes))
        self.graphs: dict[int, HookedGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self, forward: Callable[[int], torch.Tensor]) -> None:
        """Largest size first. Each size runs once eagerly first (warm-up: kernels compiled, expert cache filled), so
        captured work finds the state a replay will."""
        pool = None
        for b in reversed(self.sizes):
            graph, self.logits[b] = capture_graph(lambda b=b: forward(b), pool)
            self.graphs[b], pool = graph, graph.pool()
        torch.cuda.synchronize()

    def size_for(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def replay(self, b: int) -> torch.Tensor:
        """Replay the graph of size b -> its static logits [b, vocab]."""
        self.graphs[b].replay()
        return self.logits[b]
