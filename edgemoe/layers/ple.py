"""Per-layer embeddings (PLE, Gemma-4 and Gemma-3n): every layer adds an embedding of each token of its own.

The table is packed, `[vocab, num_layers * dim]`, and large (gigabytes) while a step needs only its tokens' rows,
so where it lives is a backend (docs: SYSTEM.md, mechanism 7; `--ple-backend`), all behind one interface,
`PLEBackend.rows`: `gpu` (`PerLayerEmbeddings`, the table resident on the model's device: the oracle), `host`
(`HostPerLayerEmbeddings`, the table in pinned host RAM, the step's rows gathered by the GPU) and `disk`
(`edgemoe.layers.ple_disk`). The family builds the `gpu` module; the loader swaps in another backend
(`edgemoe.models.ple_store`). What the model computes from the rows (Gemma-4's projection of the embedding, its norm,
the mix) stays in the family's file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def scale_in_dtype(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x * scale with the scale first rounded to x's dtype, as Gemma's scaled embeddings multiply (in bfloat16
    sqrt(3072) becomes 55.5); a Python number, so no device tensor is made (graph capture)."""
    return x * float(torch.tensor(scale).to(x.dtype))


def gather_rows_reference(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for a table on idx's device (the CPU): the `host` and `disk` backends' gather off CUDA, and the
    oracle of `edgemoe.kernels.ple_gather.gather_rows`."""
    return table.index_select(0, idx)


@dataclass(frozen=True)
class PLEOptions:
    """Where the loader puts per-layer embeddings (`EngineConfig.ple_backend`, `ple_sync`). `max_tokens`: the most
    tokens one step computes (the disk backend's staging rows)."""

    backend: str = "gpu"
    sync: str = "host"
    max_tokens: int = 512


class PLEBackend(nn.Module):
    """One place the packed table can live. `rows(input_ids)` is the whole interface the model sees: fixed shapes
    for fixed token counts, and no host synchronisation inside a captured decode step (graphs replay it).

    A backend that needs a step's token ids on the host before the step runs (the `disk` backend) also defines
    `before_step(ids: list[int])`, which `edgemoe.engine.model_runner.ModelRunner` calls before every step, eager or
    replayed."""

    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.layers, self.dim = layers, dim

    def gather(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [tokens] -> their packed rows [tokens, layers * dim], unscaled, on the ids' device."""
        raise NotImplementedError

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's rows: token ids [tokens] -> [tokens, layers, dim], scaled by sqrt(dim) (Gemma's scaled
        embedding)."""
        return scale_in_dtype(self.gather(input_ids), self.dim**0.5).view(-1, self.layers, self.dim)


class PerLayerEmbeddings(PLEBackend):
    """The `gpu` backend: the packed table as one parameter (`weight`: Hugging Face's `embed_tokens_per_layer`)."""

    def __init__(self, vocab: int, layers: int, dim: int) -> None:
        super().__init__(layers, dim)
        self.weight = nn.Parameter(torch.empty(vocab, layers * dim))

    def gather(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class HostPerLayerEmbeddings(PLEBackend):
    """The `host` backend: the table in host memory (pinned on CUDA, filled by the loader: `table` is no parameter,
    so nothing of it goes to the device), each step's rows gathered from it by the device's ids: on CUDA a kernel
    reading pinned memory through unified addressing, so it runs inside a replayed graph too."""

    def __init__(self, table: torch.Tensor, layers: int, dim: int) -> None:
        super().__init__(layers, dim)
        self.table = table  # [vocab, layers * dim]
        self._gather = gather_rows_reference

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.ple_gather import gather_rows

        self._gather = gather_rows

    def gather(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._gather(self.table, input_ids)
