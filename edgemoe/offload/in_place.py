"""Experts read in place: the RAM tier (`edgemoe.offload.ram_tier`) reads each missed expert from the checkpoint's
own files, where they hold its weights byte for byte as a host bank's row would (a GGUF's stacked expert tensors,
blocks kept as stored or floats of the compute dtype), so that no expert store is written.

A row's segments: its gate, up and down weights, each a contiguous run of its layer's stacked tensor (expert e's at
`Span.offset + e * Span.bytes`), placed where the layout puts them (`ExpertLayout.parts`); then zeros up to the
longest layer's row, as the store's rows are padded. The loader reads none of these experts: the banks it fills are
on the meta device (as a reused store's are).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.ram_tier import SEGMENT, row_stride


@dataclass(frozen=True)
class Span:
    """One weight (gate, up or down) of the `count` experts of a layer, stacked in one file: expert e's `bytes` at
    `offset + e * bytes` of `files[file]`; `name`: the tensor's, for errors."""

    name: str
    file: int
    offset: int
    bytes: int
    count: int


@dataclass(frozen=True)
class CheckpointSpans:
    """Where a checkpoint holds every offloaded MoE layer's experts: `layers[l]`, MoE layer l's gate, up and down."""

    files: list[Path]
    layers: list[tuple[Span, Span, Span]]


class InPlaceExperts:
    """The RAM tier's source (`edgemoe.offload.ram_tier.TierSource`) over `spans`, rows laid out by `layouts` (each MoE
    layer's, in order). A span whose experts or bytes an expert differ from the config's is one line (a file that does
    not match its metadata)."""

    def __init__(self, spans: CheckpointSpans, experts: int, layouts: list[ExpertLayout]) -> None:
        if len(spans.layers) != len(layouts) or not layouts:
            raise EdgeMoEError("reading experts in place needs every offloaded MoE layer's tensors")
        self.files, self.experts, self.layers = list(spans.files), experts, len(layouts)
        self.row_bytes = max(layout.row_bytes for layout in layouts)
        self.stride = row_stride(self.row_bytes)
        first = self.files[0].name
        self.name = first if len(self.files) == 1 else f"{first} ({len(self.files)} files)"  # as errors say it
        self.where = f"read in place from {self.name}"
        self._spans, self._layouts = spans.layers, layouts
        for layer, layout in zip(spans.layers, layouts):
            for span, (_, size) in zip(layer, layout.parts):
                if (span.count, span.bytes) != (experts, size):
                    raise EdgeMoEError(f"{first}: tensor {span.name} holds {span.count} experts of {span.bytes} bytes, "
                                       f"the config implies {experts} of {size}")  # fmt: skip

    def segments(self) -> torch.Tensor:
        """The RAM tier's table: gate, up, down, then the row's padding as zeros (0 bytes where there is none)."""
        E = self.experts
        out = torch.zeros(self.layers, E, 4, len(SEGMENT), dtype=torch.int64)  # [layers, experts, 4 pieces, fields]
        e = torch.arange(E, dtype=torch.int64)
        for layer, (spans, layout) in enumerate(zip(self._spans, self._layouts)):
            for piece, (span, (at, size)) in enumerate(zip(spans, layout.parts)):
                out[layer, :, piece, 0] = span.file
                out[layer, :, piece, 1] = span.offset + e * span.bytes
                out[layer, :, piece, 2] = size
                out[layer, :, piece, 3] = at
            end = max(at + size for at, size in layout.parts)
            out[layer, :, 3] = torch.tensor([-1, 0, self.row_bytes - end, end])
        return out.view(self.layers * E, 4, len(SEGMENT))

    def banks(self, layout: ExpertLayout, layer: int) -> torch.Tensor:
        """MoE layer `layer`'s bank for the loader: on the meta device, so that it reads none of the experts."""
        return torch.empty(self.experts, layout.row, dtype=layout.dtype, device="meta")

    def finish(self) -> None:
        """Nothing to write (the loader is done)."""

    def discard(self) -> None:
        """Nothing was written (loading failed)."""
