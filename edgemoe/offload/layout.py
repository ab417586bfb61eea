"""How a routed expert's weights are laid out, in host banks, device slots and resident banks alike: one seam, so
that a storage format is one class rather than edits across the offload package.

Storage is `[experts or slots, row]`: each row holds one expert's gate_up weights, then its down weights, as one run
of memory, so a miss is one copy (`copy_service.c`). A layout gives
- `views(joined)`: the gate_up and down views the expert kernels read (and the loader fills by name);
- `copy_views(joined)`: the two halves the miss copy moves (rows of the same storage; the split may be any point);
- `parts`: where gate, up and down lie in a row, in bytes (the RAM tier reads a checkpoint's weights into them in
  place, `edgemoe.offload.in_place`);
- `decode`: the decode function that reads `views` in place; `pair_outputs`, prefill's (every pair of a step in one
  call, rows -1 skipped: waves of offloaded experts equal one call), over `dense_gate_up`/`dense_down`;
- `decode_cpu`: decode with some pairs' outputs computed on the CPU (`edgemoe.offload.cpu_split`).

`ExpertLayout` keeps experts in the model's dtype; `QuantExpertLayout` keeps GGUF blocks (`edgemoe.quant`) as
stored, one format for gate_up and one for down. The layers of one model may use different formats (Q4_K_M files
do): they then share one storage row, the longest of them (`row`), so that one slot pool serves every layer.
A layout also names the gated activation (`act`, a key of `edgemoe.layers.mlp.GLUS`: SiLU unless the family says
otherwise): the kernels compute SiLU and gpt-oss's clamped SwiGLU (`edgemoe.kernels.moe_gemv.ACTS`); others keep the
plain-torch references. Expert biases (gpt-oss) are not in the row: the module holding the layer's experts keeps
them on the device by expert and hands kernels and references each pair's (`PairBiases`, the `bias` keyword).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from edgemoe.kernels.protocol import CpuWait, PairBiases
from edgemoe.layers.mlp import GLUS
from edgemoe.moe.experts import decode_reference, gathered_experts, pair_outputs_reference
from edgemoe.quant import QuantLike, dequantize, quant_type, row_bytes


class ExpertLayout:
    """Dense experts (the model's dtype): gate_up [2I, H] (gate rows first), then down [H, I]."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, act: str = "silu") -> None:
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.row = 3 * inter * hidden  # elements of one expert's row
        self.split = 2 * inter * hidden  # where down starts
        self.act_name, self.glu = act, GLUS[act]
        self._prefill_references()
        # (x, ids, weights, w13, w2, arrivals=, bias=) -> [T, H]
        self.decode: Callable = decode_reference if act == "silu" else partial(decode_reference, glu=self.glu)
        self.decode_waits = False  # whether `decode` waits for each copied expert itself (the kernels do)
        # (x, slots, weights, w13, w2, cpu_out, arrivals=, cpu_wait=, bias=) -> [T, H]: `decode` with CPU pairs' rows
        self.decode_cpu: Callable = self._decode_cpu_reference

    def _prefill_references(self) -> None:
        # prefill's routed experts, every pair in one call (x, rows [pairs] (-1: skipped), weights [pairs], w13, w2,
        # out=) -> out [pairs, H]: `pair_outputs_reference` over these views, the kernel once `use_kernels` chose it
        # (dense SiLU experts: `edgemoe.kernels.grouped_gemm`)
        self.pair_outputs: Callable = partial(
            pair_outputs_reference, glu=self.glu, dense13=self.dense_gate_up, dense2=self.dense_down
        )

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.grouped_gemm import pair_outputs
        from edgemoe.kernels.moe_gemv import ACTS, fused_experts

        if self.act_name not in ACTS:  # an activation the kernels do not compute
            return
        fused = partial(fused_experts, act=self.act_name)
        self.decode, self.decode_waits = fused, True
        self.pair_outputs = partial(pair_outputs, act=self.act_name)
        self.decode_cpu = partial(_fused_cpu, fused)

    @property
    def row_bytes(self) -> int:
        return self.row * self.dtype.itemsize

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        """(offset, bytes) of an expert's gate, up and down weights in its row: gate_up's first and last halves."""
        half = self.inter * self.hidden * self.dtype.itemsize
        return (0, half), (half, half), (2 * half, self.hidden * self.inter * self.dtype.itemsize)

    def empty(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Uninitialised storage of `rows` expert rows -> joined [rows, row]."""
        return torch.empty(rows, self.row, dtype=self.dtype, device=device)

    def views(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [N, 2I, H] and down [N, H, I] views of `joined` [N, row]."""
        H, inter = self.hidden, self.inter
        assert joined.shape[1] == self.row and joined.stride(1) == 1
        return joined[:, : self.split].unflatten(1, (2 * inter, H)), joined[:, self.split :].unflatten(1, (H, inter))

    def copy_views(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views(joined)

    def _decode_cpu_reference(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        cpu_out: torch.Tensor, arrivals=None, cpu_wait: CpuWait | None = None,  # noqa: ANN001 - decode's
        bias: PairBiases | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`decode` where pairs of slot -1 were computed on the CPU (`cpu_out` [T * K, H] fp32, their rows): every
        other pair's output as `decode` computes it (itself, one pair a token, weight 1), the CPU's rounded to x's
        dtype as those are, then the weighted sum over k of `gathered_experts`. Where no pair is on the CPU, the plain
        reference's result bitwise. `cpu_wait` (a captured step, CUDA): the rows arrive from the copy service, so the
        stream waits for them (a one-program kernel) after `decode` and before the sum."""
        tokens, top_k = slots.shape
        flat = slots.reshape(-1)
        on_cpu = flat < 0  # [pairs]
        scratch = torch.full_like(flat, w13.shape[0] - 1)  # a slot to read instead: the pool's scratch slot
        xs = x.repeat_interleave(top_k, dim=0)  # [pairs, H]
        ones = torch.ones(flat.numel(), 1, dtype=x.dtype, device=x.device)
        bias = {} if bias is None else {"bias": bias}  # one pair a row, in pair order: the pairs' own biases
        out = self.decode(xs, torch.where(on_cpu, scratch, flat)[:, None], ones, w13, w2, arrivals=arrivals, **bias)
        if cpu_wait is not None:
            from edgemoe.kernels.miss_copy import await_cpu_rows

            await_cpu_rows(cpu_wait)
        out = torch.where(on_cpu[:, None], cpu_out.to(out.dtype), out).view(tokens, top_k, -1)  # [T, K, H]
        return (out * weights[:, :, None]).sum(dim=1)

    def dense_gate_up(self, w13: torch.Tensor) -> torch.Tensor:
        """gate_up rows of any leading shape, in the compute dtype (dense: themselves)."""
        return w13

    def dense_down(self, w2: torch.Tensor) -> torch.Tensor:
        return w2


class QuantExpertLayout(ExpertLayout):
    """Experts as GGUF blocks: gate_up [2I, row_bytes(q_gate_up, H)], then down [H, row_bytes(q_down, I)], uint8.
    `row`: the storage row in bytes when layers of other formats share the pool (default: this layer's own)."""

    def __init__(
        self, hidden: int, inter: int, q_gate_up: QuantLike, q_down: QuantLike, compute_dtype: torch.dtype,
        row: int | None = None, copy_split: int | None = None, act: str = "silu",
    ) -> None:  # fmt: skip
        self.hidden, self.inter, self.dtype = hidden, inter, torch.uint8
        self.act_name, self.glu = act, GLUS[act]
        self.q_gate_up, self.q_down, self.compute_dtype = quant_type(q_gate_up), quant_type(q_down), compute_dtype
        self.gu_bytes, self.down_bytes = row_bytes(self.q_gate_up, hidden), row_bytes(self.q_down, inter)
        self.split = 2 * inter * self.gu_bytes
        self.used = self.split + hidden * self.down_bytes
        self.row = row or self.used
        self.copy_split = copy_split or self.split
        assert self.row >= self.used and 0 < self.copy_split < self.row
        self.decode, self.decode_waits = self._decode_reference, False
        self.decode_cpu = self._decode_cpu_reference  # over `decode`
        self._prefill_references()

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.dequant import quant_pair_outputs
        from edgemoe.kernels.moe_gemv import ACTS
        from edgemoe.kernels.quant_gemv import quant_fused_experts

        if self.act_name not in ACTS:  # an activation the kernels do not compute
            return
        q_gu, q_down, inter, hidden, act = self.q_gate_up, self.q_down, self.inter, self.hidden, self.act_name
        # prefill: waves dequantized for the GEMM
        self.pair_outputs = partial(quant_pair_outputs, q13=q_gu, q2=q_down, act=act)

        def decode(x, ids, weights, w13, w2, arrivals=None, bias=None):  # noqa: ANN001, ANN202 - decode's signature
            return quant_fused_experts(
                x, ids, weights, w13, w2, q_gu, q_down, inter, hidden, arrivals=arrivals, bias=bias, act=act
            )

        def decode_cpu(x, ids, weights, w13, w2, cpu_out, arrivals=None, cpu_wait=None, bias=None):  # noqa: ANN001, ANN202
            return quant_fused_experts(x, ids, weights, w13, w2, q_gu, q_down, inter, hidden, arrivals=arrivals,
                                       cpu_out=cpu_out, cpu_wait=cpu_wait, bias=bias, act=act)  # fmt: skip

        # the kernels read CPU pairs' rows themselves (and wait for them in a captured step), as the dense one does
        self.decode, self.decode_cpu, self.decode_waits = decode, decode_cpu, True

    def views(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [N, 2I, gu_bytes] and down [N, H, down_bytes] uint8 views of `joined` [N, row]."""
        assert joined.shape[1] == self.row and joined.stride(1) == 1 and joined.dtype == torch.uint8
        w13 = joined[:, : self.split].unflatten(1, (2 * self.inter, self.gu_bytes))
        w2 = joined[:, self.split : self.used].unflatten(1, (self.hidden, self.down_bytes))
        return w13, w2

    def copy_views(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return joined[:, : self.copy_split], joined[:, self.copy_split :]

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        half = self.inter * self.gu_bytes
        return (0, half), (half, half), (self.split, self.hidden * self.down_bytes)

    def dense_gate_up(self, w13: torch.Tensor) -> torch.Tensor:
        return dequantize(w13, self.q_gate_up, self.hidden).to(self.compute_dtype)

    def dense_down(self, w2: torch.Tensor) -> torch.Tensor:
        return dequantize(w2, self.q_down, self.inter).to(self.compute_dtype)

    def _decode_reference(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        arrivals=None, bias: PairBiases | None = None,  # noqa: ANN001 - the kernel's signature; the copy is done
    ) -> torch.Tensor:  # fmt: skip
        """Decode in plain torch (the kernels' reference): fixed shapes, every pair's expert dequantized."""
        tokens, top_k = ids.shape
        flat = ids.flatten()
        pairs = torch.arange(flat.numel(), device=ids.device).view(tokens, top_k)
        w13, w2 = self.dense_gate_up(w13[flat]), self.dense_down(w2[flat])
        return gathered_experts(x, pairs, weights, w13, w2, self.glu, bias)


def _fused_cpu(
    fused: Callable, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    cpu_out: torch.Tensor, arrivals=None, cpu_wait: CpuWait | None = None,  # noqa: ANN001 - decode's
    bias: PairBiases | None = None,
) -> torch.Tensor:  # fmt: skip
    """The dense kernel's `decode_cpu`: the kernel reads CPU pairs' rows itself, and waits for them in a captured step
    (`edgemoe.kernels.moe_gemv`)."""
    return fused(x, slots, weights, w13, w2, arrivals=arrivals, cpu_out=cpu_out, cpu_wait=cpu_wait, bias=bias)


def split_rows(joined: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up and down views of `joined` [N, 3 * I * H] in the dense layout (`ExpertLayout.views`)."""
    return ExpertLayout(hidden, inter, joined.dtype).views(joined)
