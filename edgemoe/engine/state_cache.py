"""Per-sequence state beside the paged KV cache, for layers that remember the past in a fixed-size state instead of
K/V (the Gated DeltaNet layers of the hybrid families: a convolution's last inputs and a matrix per head).

A module keeps state when it has `state_shapes(dtype) -> [(shape, dtype), ...]` (one sequence's tensors) and
`bind_state(*tensors)`. The cache gives every such module, in order, views [slots + 1, *shape] of one pool: a slot is
one row of bytes holding every layer's state of one sequence, so that clearing or copying a sequence's whole state
is one operation. A running sequence holds one slot (`allocate` clears it); the last row is the pad slot, which
padding rows of a captured decode batch and the warm-up prefills write and read, as the KV cache's pad block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ALIGN = 16  # bytes: each state starts aligned within a slot's row


def stateful_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "state_shapes", None))]


def _layout(modules: list[nn.Module], dtype: torch.dtype) -> tuple[list[list[tuple]], int]:
    """Per module, its states' (offset, shape, dtype) in a slot's row, and the row's bytes."""
    layout, offset = [], 0
    for m in modules:
        own = []
        for shape, dt in m.state_shapes(dtype):
            own.append((offset, shape, dt))
            offset += -(-math.prod(shape) * dt.itemsize // ALIGN) * ALIGN
        layout.append(own)
    return layout, offset


def bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """One sequence's state in every layer that keeps one (0: a model without such layers)."""
    return _layout(stateful_modules(model), dtype)[1]


class StateCache:
    def __init__(self, model: nn.Module, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        modules = stateful_modules(model)
        layout, self.row_bytes = _layout(modules, dtype)
        self.pool = torch.zeros(slots + 1, self.row_bytes, dtype=torch.uint8, device=device)
        for module, own in zip(modules, layout):
            module.bind_state(*(self._view(offset, shape, dt) for offset, shape, dt in own))
        self.num_slots, self.pad_slot = slots, slots
        self.free: list[int] = list(range(slots - 1, -1, -1))  # a stack: pop() gives low slots first

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Every slot's copy of one state: [slots + 1, *shape], rows `row_bytes` apart."""
        n = math.prod(shape) * dtype.itemsize
        rows = self.pool[:, offset : offset + n]
        return rows.view(dtype).view(self.pool.shape[0], *shape)

    @property
    def num_bytes(self) -> int:
        return self.pool.numel()

    def allocate(self) -> int:
        """A slot for a sequence that starts from its first token: cleared (a state of zeros)."""
        if not self.free:
            raise RuntimeError("no free state slot (the scheduler admits at most max_num_seqs sequences)")
        slot = self.free.pop()
        self.pool[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)
