"""Routing traces: the routed expert ids of one sequence's decode, saved as `.npy` int32 [steps, moe_layers, top_k]
for offline policy study (`edgemoe cache-sim`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError


class RoutingRecorder:
    """Records the first sequence that decodes and saves its trace when that sequence finishes. Every MoE layer writes
    each decode step's routed ids to `routed_ids` [moe_layers, rows, top_k] (the runner's buffer, graphs included:
    `ForwardContext.routed_ids`); the engine calls `begin` before and `end` after each step."""

    def __init__(self, routed_ids: torch.Tensor, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise EdgeMoEError(f"cannot record routing to {self.path}: {self.path.parent} is not a folder")
        self.routed_ids = routed_ids
        self.seq_id: int | None = None
        self.row: int | None = None  # the recorded sequence's first row in this step's batch
        self.computed = 0  # its tokens computed before this step
        self.steps: list[torch.Tensor] = []  # [moe_layers, top_k] per decode step (device)
        self.done = False

    def begin(self, batch) -> None:
        self.row = None
        if self.done or batch.is_prefill:
            return
        if self.seq_id is None:
            self.seq_id = batch.seqs[0].seq_id
        row = 0  # a decode step's rows are its tokens: a verify step gives a sequence one a position
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.seq_id == self.seq_id:
                self.row, self.computed = row, seq.num_computed
                return
            row += n

    def end(self, batch) -> None:
        if self.row is not None:
            seq = next(s for s in batch.seqs if s.seq_id == self.seq_id)
            for r in range(self.row, self.row + seq.num_computed - self.computed):  # its token, the accepted drafts
                self.steps.append(self.routed_ids[:, r].clone())
        self.row = None
        if not self.done and any(s.seq_id == self.seq_id and s.finish_reason for s in batch.seqs):
            self.save()

    def save(self) -> None:
        layers, _, top_k = self.routed_ids.shape
        empty = np.zeros((0, layers, top_k))
        trace = torch.stack(self.steps).cpu().numpy() if self.steps else empty
        np.save(self.path, trace.astype(np.int32))
        self.done = True
