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
    `edgemoe.kernels.grouped_gemm.grouped_gemm`: `gathered_experts` for few pairs, else `grouped_experts`."""
    if ids.numel() <= w13.shape[0]:
        return gathered_experts(x, ids, weights, w13, w2, act)
    return grouped_experts(x, ids, weights, w13, w2, act)


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


def grouped_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Act = F.silu
) -> torch.Tensor:
    """Pairs sorted by expert, one matmul per expert that has tokens (prefill: many tokens per expert)."""
    tokens, top_k = ids.shape
    order = ids.flatten().argsort(stable=True)  # pair indices grouped by expert
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0]).tolist()
    token_of_pair = order // top_k
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        tok = token_of_pair[start : start + n]
        gate, up = F.linear(x[tok], w13[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w2[expert]) * weights.flatten()[pairs, None]
        out.index_add_(0, tok, y)
        start += n
    return out
