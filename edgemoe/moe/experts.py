"""Routed-expert compute: only the experts a token chose run (never all experts densely).

Weights are two banks in Hugging Face's fused layout: `gate_up_proj [experts, 2 * inter, hidden]`
(gate rows first) and `down_proj [experts, hidden, inter]`. The gate's activation is SiLU unless a family names
another (`act`, one of `edgemoe.layers.mlp.ACTIVATIONS`: Gemma-4's GELU-tanh); the Triton kernels compute SiLU only.
On CUDA decode runs the fused GEMVs (`edgemoe.kernels.moe_gemv`) and prefill one grouped GEMM over all pairs
(`edgemoe.kernels.grouped_gemm`); the functions here are their plain-torch references.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.context import get_context
from edgemoe.layers.mlp import ACTIVATIONS

Act = Callable[[torch.Tensor], torch.Tensor]


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.act_name, self.act = act, ACTIVATIONS[act]
        silu = act == "silu"
        self.decode = decode_reference if silu else partial(decode_reference, act=self.act)
        self.prefill: Callable = prefill_reference if silu else partial(prefill_reference, act=self.act)

    def use_kernels(self, device: torch.device) -> None:
        if self.act_name != "silu":  # the kernels compute SiLU: other activations keep the references
            return
        from edgemoe.kernels.grouped_gemm import grouped_gemm
        from edgemoe.kernels.moe_gemv import fused_experts

        self.decode = fused_experts  # reads the chosen experts in place
        self.prefill = grouped_gemm  # every pair in two launches, no host synchronisation

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]; ids, weights: [tokens, top_k]
        if not get_context().is_prefill:  # sync-free, graph-capturable
            return self.decode(x, ids, weights, self.gate_up_proj, self.down_proj)
        return self.prefill(x, ids, weights, self.gate_up_proj, self.down_proj)


def decode_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    arrivals=None,  # noqa: ANN001 - the kernel's signature; the copy is done when this runs
    act: Act = F.silu,
) -> torch.Tensor:
    """Decode's routed experts in plain torch (`gathered_experts`; the copy is done when `arrivals` is given), with
    the signature of their kernel `edgemoe.kernels.moe_gemv.fused_experts`. Fixed shapes, no host synchronisation."""
    return gathered_experts(x, ids, weights, w13, w2, act)


def prefill_reference(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Act = F.silu
) -> torch.Tensor:
    """Prefill's routed experts in plain torch, with the signature of their kernel
    `edgemoe.kernels.grouped_gemm.grouped_gemm`: `pair_outputs_reference`, each token's pairs summed as the kernel
    sums them (`sum_pairs`)."""
    return sum_pairs(pair_outputs_reference(x, ids.flatten(), weights.flatten(), w13, w2, act=act), ids.shape[1])


def pair_outputs_reference(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
    act: Act = F.silu,
    dense13: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
    dense2: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
) -> torch.Tensor:
    """`edgemoe.kernels.grouped_gemm.pair_outputs` in plain torch: x [T, H]; rows [T * K] the bank row of each pair
    (-1: skipped, its row of `out` untouched); weights [T * K] -> out [T * K, H], each pair's expert output times its
    weight. One pair of matmuls per bank row over all of its pairs, so a row's pairs come out bitwise the same
    whichever other rows a call computes: waves of experts (offloaded prefill) equal one call. `dense13`, `dense2`:
    a layout's dequantization of a bank row (quantized experts)."""
    T, H = x.shape
    K = rows.numel() // max(T, 1)
    out = x.new_empty(rows.numel(), H) if out is None else out
    flat = rows.flatten()
    order = flat.argsort(stable=True)  # pairs grouped by row, in pair order within each
    counts = torch.bincount(flat + 1, minlength=1)[1:].tolist()  # row r's pairs (the -1s counted apart, dropped)
    start = int((flat < 0).sum())
    for row, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        gate, up = F.linear(x[pairs // K], dense13(w13[row])).chunk(2, dim=-1)
        out[pairs] = F.linear(act(gate) * up, dense2(w2[row])) * weights[pairs, None]
        start += n
    return out


def sum_pairs(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y: [T * K, H] pair outputs -> [T, H]: each token's K rows summed in fp32 (a fixed order), rounded once."""
    return y.view(-1, top_k, y.shape[-1]).sum(dim=1, dtype=torch.float32).to(y.dtype)


def gathered_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Act = F.silu
) -> torch.Tensor:
    """One batched matmul over the (token, expert) pairs, with the pairs' weights gathered.

    Fixed shapes and no host synchronisation (decode, CUDA graphs); costs a copy of each chosen expert,
    so it is used only when there are few pairs.
    """
    tokens, top_k = ids.shape
    flat = ids.flatten()
    xs = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [pairs, hidden, 1]
    gate, up = torch.bmm(w13[flat], xs)[:, :, 0].chunk(2, dim=-1)  # [pairs, inter] each
    h = (act(gate) * up)[:, :, None]
    out = torch.bmm(w2[flat], h)[:, :, 0].view(tokens, top_k, -1)  # [tokens, top_k, hidden]
    return (out * weights[:, :, None]).sum(dim=1)
