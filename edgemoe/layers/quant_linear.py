"""Dense weights as a GGUF file stores them, and the token embedding in host memory.

`QuantLinear` stands in for a `DecodeLinear` whose weight the file holds in block formats the kernels read (Q4_K_M
files: attention, shared experts and the lm_head in Q4_K / Q6_K): the blocks stay as stored on the device (3.5x fewer
bytes than bf16, counted by `--vram-budget` as they are). Decode reads them in place (`edgemoe.kernels.quant_gemv.
quant_linear`, batch-invariant); prefill dequantizes a weight for the step (`edgemoe.kernels.dequant`) and multiplies
with cuBLAS. A fused projection whose checkpoint parts differ in format (q and k in Q4_K, v in Q6_K) keeps one part per
run of rows of one format, each written into its columns of one output.

`HostEmbedding` keeps the token embedding in (pinned) host memory: a step needs a row per token, gathered by the
device through unified addressing (`edgemoe.kernels.ple_gather`), so the table's hundreds of MiB leave the card.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.context import get_context
from edgemoe.layers.ple import gather_rows_reference
from edgemoe.quant import QuantLike, QuantType, dequantize, quant_type, row_bytes

GEMV_ROWS = 16  # prefill rows up to which the GEMV reads the blocks (a step's logits, a short chunk)
DEQUANTIZE_BYTES = 256 << 20  # larger weights are never dequantized whole (an lm_head: 622 MiB in bf16)


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W [out_features, in_features] stored as GGUF blocks: `parts` (rows, format) in row
    order, each a uint8 buffer `raw{i}` [rows, row_bytes(format, in_features)]; `bias` stays a float parameter."""

    def __init__(
        self, in_features: int, out_features: int, parts: list[tuple[int, QuantLike]], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts: list[tuple[int, int, QuantType]] = []  # (first row, rows, format)
        start = 0
        for i, (rows, q) in enumerate(parts):
            q = quant_type(q)
            raw = torch.empty(rows, row_bytes(q, in_features), dtype=torch.uint8)
            self.register_buffer(f"raw{i}", raw, persistent=False)
            self.parts.append((start, rows, q))
            start += rows
        assert start == out_features, f"parts of {start} rows for {out_features} outputs"
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._gemv = self._dequantize = None  # the kernels, once `use_kernels` chose them

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.dequant import dequantize_weight
        from edgemoe.kernels.quant_gemv import quant_linear

        self._gemv, self._dequantize = quant_linear, dequantize_weight

    def raw(self, i: int) -> torch.Tensor:
        return getattr(self, f"raw{i}")

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W dequantized, [out_features, in_features] in `dtype` (the reference's weight; prefill's on CUDA)."""
        K = self.in_features
        if self._dequantize is not None:  # the device kernel: bitwise the reference, rounded to dtype
            parts = [self._dequantize(self.raw(i), q, K, dtype) for i, (_, _, q) in enumerate(self.parts)]
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        parts = [dequantize(self.raw(i), q, K) for i, (_, _, q) in enumerate(self.parts)]
        return torch.cat(parts).to(dtype)

    def prefill_scratch_bytes(self, dtype: torch.dtype) -> int:
        """Device bytes prefill dequantizes this weight into (0: it never does)."""
        size = self.out_features * self.in_features * dtype.itemsize
        return size if self._gemv is not None and size <= DEQUANTIZE_BYTES else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        small = self.out_features * self.in_features * x.element_size() <= DEQUANTIZE_BYTES
        if self._gemv is None or (get_context().is_prefill and flat.shape[0] > GEMV_ROWS and small):
            # the reference, and prefill on CUDA: the weight dequantized for the step, then cuBLAS
            return F.linear(x, self.dense_weight(x.dtype), self.bias)
        out = torch.empty(flat.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for i, (start, rows, q) in enumerate(self.parts):  # decode: the blocks read in place, each part's columns
            bias = None if self.bias is None else self.bias[start : start + rows]
            self._gemv(flat, self.raw(i), q, bias=bias, out=out[:, start : start + rows])
        return out.view(*x.shape[:-1], self.out_features)


class HostEmbedding(nn.Module):
    """The token embedding with its table in host memory (pinned on CUDA; no parameter, so nothing of it moves to the
    device): `table` [vocab, hidden] in the model's dtype, filled by the loader under the embedding's name."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.shape
        self._gather = None  # the device gather, once `use_kernels` chose it

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.ple_gather import gather_rows

        self._gather = gather_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._gather is None:
            if input_ids.device != self.table.device:  # a reference only (kernels read pinned memory)
                return gather_rows_reference(self.table, input_ids.cpu()).to(input_ids.device)
            return F.embedding(input_ids, self.table)
        flat = input_ids.reshape(-1)
        return self._gather(self.table, flat).view(*input_ids.shape, self.embedding_dim)
