"""Routing traces: the routed expert ids of one sequence's decode, saved as `.npy` int32 [steps, moe_layers, top_k]
for offline policy study (`edgemoe cache-sim`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgemoe.errors import EdgeMoEError


class RoutingRecorder:
    """Records the first sequence that decodes, from each MoE layer's experts call, and saves the trace when that
    sequence finishes. The engine calls `begin` before and `end` after each step."""

    def __init__(self, model: nn.Module, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise EdgeMoEError(f"cannot record routing to {self.path}: {self.path.parent} is not a folder")
        self.top_k = model.config.top_k
        self.seq_id: int | None = None
        self.row: int | None = None  # the recorded sequence's row in this step's batch
        self.steps: list[torch.Tensor] = []  # [moe_layers, top_k] per decode step (device)
        self._step: list[torch.Tensor] = []
        self.done = False
        moe_layers = [layer for layer in model.model.layers if layer.is_moe]
        self.num_layers = len(moe_layers)
        for layer in moe_layers:
            layer.mlp.experts.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple) -> None:
        if self.row is not None:
            self._step.append(args[1][self.row].clone())  # args: (x, ids, weights)

    def begin(self, batch) -> None:
        self.row = None
        if self.done or batch.is_prefill:
            return
        if self.seq_id is None:
            self.seq_id = batch.seqs[0].seq_id
        ids = [s.seq_id for s in batch.seqs]
        self.row = ids.index(self.seq_id) if self.seq_id in ids else None

    def end(self, batch) -> None:
        if self._step:
            self.steps.append(torch.stack(self._step))
            self._step = []
        self.row = None
        if not self.done and any(s.seq_id == self.seq_id and s.finish_reason for s in batch.seqs):
            self.save()

    def save(self) -> None:
        empty = np.zeros((0, self.num_layers, self.top_k))
        trace = torch.stack(self.steps).cpu().numpy() if self.steps else empty
        np.save(self.path, trace.astype(np.int32))
        self.done = True
