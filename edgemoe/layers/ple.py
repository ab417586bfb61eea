"""Per-layer embeddings (PLE, Gemma-4 and Gemma-3n): every layer adds an embedding of each token of its own.

The table is packed, `[vocab, num_layers * dim]`, and large (gigabytes) while a step needs only its tokens' rows,
so where it lives is a backend (docs: SYSTEM.md, mechanism 7). `PerLayerEmbeddings` is the `gpu` backend, the table
resident on the model's device: the oracle of the `host` and `disk` backends to come, which will implement the same
`rows` and replace this module without touching the layers. What the model computes from the rows (Gemma-4's
projection of the embedding, its norm, the mix) stays in the family's file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def scale_in_dtype(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x * scale with the scale first rounded to x's dtype, as Gemma's scaled embeddings multiply (in bfloat16
    sqrt(3072) becomes 55.5); a Python number, so no device tensor is made (graph capture)."""
    return x * float(torch.tensor(scale).to(x.dtype))


class PerLayerEmbeddings(nn.Module):
    """The `gpu` backend: the packed table as one parameter (`weight`: Hugging Face's `embed_tokens_per_layer`)."""

    def __init__(self, vocab: int, layers: int, dim: int) -> None:
        super().__init__()
        self.layers, self.dim = layers, dim
        self.weight = nn.Parameter(torch.empty(vocab, layers * dim))

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's rows: token ids [tokens] -> [tokens, layers, dim], scaled by sqrt(dim) (Gemma's scaled
        embedding). Fixed shapes, no host synchronisation: a backend must keep that (decode graphs replay it)."""
        return scale_in_dtype(F.embedding(input_ids, self.weight), self.dim**0.5).view(-1, self.layers, self.dim)
