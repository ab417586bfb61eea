"""Decode CUDA graphs: one graph per batch size, replayed with static input and output buffers.

A decode batch of n sequences runs the graph of the smallest captured size b >= n; rows n..b-1 are padding:
token 0 at position 0, writing its K/V into the KV cache's pad block, attending to that block alone, and
routed to row 0's experts (so padding never fetches or counts an expert). Block
tables are padded to the longest context the engine allows, so shapes never change between replays.

Upload policy (`GRAPH_UPLOADS`): `capture` uploads each graph (`cudaGraphUpload` + sync) when it is captured,
`none` leaves the upload to the first replay, `auto` uploads only where a first launch must not block (no
backend needs that yet, so today it is `none`: uploading at capture time widened the gaps between kernels in the
engine we follow). `warm_replay` replays each graph once at capture time instead.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

from edgemoe.config import GRAPH_UPLOADS
from edgemoe.engine.context import ForwardContext, set_context
from edgemoe.engine.kv_cache import KVCache
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.moe.copy_service import recording_posts

T = TypeVar("T")


def uploads_at_capture(policy: str) -> bool:
    """Whether `policy` uploads graphs at capture time (`auto`: only for a backend whose first launch must not
    block; there is none yet)."""
    if policy not in GRAPH_UPLOADS:
        raise ValueError(f"unknown graph upload policy {policy!r}")
    return policy == "capture"


class ServedGraph(torch.cuda.CUDAGraph):
    """A captured CUDA graph whose `replay` also serves the copy lists it posts (`edgemoe.moe.copy_service`): a
    decode step with offloaded experts waits on the GPU for the copies it posted, so a replay that nobody served
    would never end. Such a replay returns once it has run; one that posts nothing returns at once, as torch's."""

    copy_services: tuple = ()  # the services its capture posted to

    def replay(self) -> None:
        super().replay()
        for service in self.copy_services:
            service.serve()


def capture_graph(
    fn: Callable[[], T], pool: tuple | None = None, upload: str = "auto", warm_replay: bool = False
) -> tuple[ServedGraph, T]:
    """`fn` once eagerly on a side stream (kernels compiled, allocator and caches warmed, so the captured work finds
    the state a replay will), then captured (into `pool` when given); uploaded or replayed once per the policy.
    -> (graph, what the captured call returned: its static outputs).

    Garbage is collected before the capture and the collector is off during it: a dead CUDA graph (say, of an engine
    left in a reference cycle) destroyed mid-capture invalidates the capture, and torch no longer collects when a
    capture begins."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = ServedGraph()
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with recording_posts() as services, torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    graph.copy_services = tuple(services)
    if uploads_at_capture(upload):
        from edgemoe.engine.streams import upload_graph

        upload_graph(graph, torch.cuda.current_stream())
        torch.cuda.synchronize()
    if warm_replay:
        graph.replay()
        torch.cuda.synchronize()
    return graph, out


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, and max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: MoEForCausalLM,
        kv: KVCache,
        sizes: list[int],
        max_blocks: int,
        upload: str = "auto",
        warm_replay: bool = False,
    ) -> None:
        self.model, self.kv, self.sizes, self.max_blocks = model, kv, sorted(set(sizes)), max_blocks
        uploads_at_capture(upload)  # a bad policy fails here, before any capture
        self.upload, self.warm_replay = upload, warm_replay
        device, b = kv.k.device, max(sizes)
        self.pad_slot = kv.pad_block * kv.block_size
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), self.pad_slot, dtype=torch.long, device=device)
        self.context_lens = torch.ones(b, dtype=torch.long, device=device)
        self.block_tables = torch.full((b, max_blocks), kv.pad_block, dtype=torch.long, device=device)
        self.valid = torch.ones(b, dtype=torch.bool, device=device)
        self.graphs: dict[int, ServedGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        ctx = ForwardContext(
            False, self.slot_mapping[:b], self.context_lens[:b], self.block_tables[:b], valid=self.valid[:b]
        )
        set_context(ctx)
        try:
            return self.model.logits(self.model(self.input_ids[:b], self.positions[:b]))
        finally:
            set_context(None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, all graphs sharing one memory pool. Each size runs once eagerly first (warm-up:
        kernels compiled, expert cache filled), so captured work finds the same state a replay will. A warm replay
        runs on the padding inputs the static buffers hold (KV writes land in the pad block)."""
        pool = None
        for b in reversed(self.sizes):
            graph, self.logits[b] = capture_graph(lambda b=b: self._forward(b), pool, self.upload, self.warm_replay)
            self.graphs[b], pool = graph, graph.pool()
        torch.cuda.synchronize()

    def size_for(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def replay(
        self, ids: list[int], positions: list[int], slots: list[int], context_lens: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Fill the static inputs (padding rows past len(ids)), replay, return logits [len(ids), vocab]."""
        n, b = len(ids), self.size_for(len(ids))
        width = self.max_blocks
        rows = [t + [self.kv.pad_block] * (width - len(t)) for t in tables]
        pad = b - n
        host = torch.tensor(
            [
                [*ids, *[0] * pad],
                [*positions, *[0] * pad],
                [*slots, *[self.pad_slot] * pad],
                [*context_lens, *[1] * pad],
                [*[1] * n, *[0] * pad],  # valid rows
            ],
            dtype=torch.long,
        )
        table = torch.tensor(rows + [[self.kv.pad_block] * width] * pad, dtype=torch.long)
        if self.input_ids.is_cuda:  # pinned staging: the copies below do not wait for the host
            host, table = host.pin_memory(), table.pin_memory()
        statics = (self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.valid)
        for dst, src in zip(statics, host, strict=True):
            dst[:b].copy_(src, non_blocking=True)  # (the valid row converts long -> bool)
        self.block_tables[:b].copy_(table, non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n]
