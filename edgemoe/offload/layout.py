"""How an offloaded expert's weights are laid out, in host banks and device slots alike: one seam, so that another
storage format (quantized blocks) is one new class rather than edits across the offload package.

A bank is `[experts, row]` and the slot pool `[slots + 1, row]`; each row holds one expert's gate_up weights, then
its down weights, as one run of memory, so a miss is one copy (`copy_service.c`). The layout gives the views the
expert kernels read, and which decode function reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edgemoe.moe.experts import decode_reference


class ExpertLayout:
    """Dense experts (the model's dtype): gate_up [2I, H] (gate rows first), then down [H, I]."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.row = 3 * inter * hidden  # elements of one expert's row
        self.decode: Callable = decode_reference  # (x, ids, weights, w13, w2, arrivals=) -> [T, H]

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.moe_gemv import fused_experts

        self.decode = fused_experts

    @property
    def row_bytes(self) -> int:
        return self.row * self.dtype.itemsize

    def empty(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Uninitialised storage of `rows` expert rows -> joined [rows, row]."""
        return torch.empty(rows, self.row, dtype=self.dtype, device=device)

    def views(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [N, 2I, H] and down [N, H, I] views of `joined` [N, row] (the loader fills them by name, the
        kernels read them in place)."""
        split, (H, inter) = 2 * self.inter * self.hidden, (self.hidden, self.inter)
        assert joined.shape[1] == self.row and joined.stride(1) == 1
        return joined[:, :split].unflatten(1, (2 * inter, H)), joined[:, split:].unflatten(1, (H, inter))


def split_rows(joined: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up and down views of `joined` [N, 3 * I * H] in the dense layout (`ExpertLayout.views`)."""
    return ExpertLayout(hidden, inter, joined.dtype).views(joined)
