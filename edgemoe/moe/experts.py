"""Routed-expert compute: only the experts a token chose run (never all experts densely).

Weights are two banks in Hugging Face's fused layout: `gate_up_proj [experts, 2 * inter, hidden]`
(gate rows first) and `down_proj [experts, hidden, inter]`. The gated activation is SiLU(gate) * up unless a family
names another (`act`, one of `edgemoe.layers.mlp.GLUS`: Gemma-4's GELU-tanh, gpt-oss's clamped SwiGLU); a family may
give its experts biases (gpt-oss: `gate_up_proj_bias [experts, 2 * inter]`, `down_proj_bias [experts, hidden]`), which
kernels and references add per pair (`PairBiases`). The Triton kernels compute SiLU and gpt-oss's activation
(`edgemoe.kernels.moe_gemv.ACTS`), not GELU. On CUDA decode runs the fused GEMVs (`edgemoe.kernels.moe_gemv`) and
prefill one grouped GEMM over all pairs (`edgemoe.kernels.grouped_gemm`); the functions here are their plain-torch
references.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.context import get_context
from edgemoe.kernels.protocol import PairBiases
from edgemoe.layers.mlp import GLUS

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> the down projection's input
silu_glu = GLUS["silu"]


def pair_biases(module: nn.Module, ids: torch.Tensor) -> dict[str, PairBiases]:
    """The `bias` keyword of a reference for `module`'s pairs of experts `ids` [tokens, top_k] where it has biases
    (`gate_up_proj_bias`, `down_proj_bias`), else none: the kernels take no such keyword."""
    if getattr(module, "gate_up_proj_bias", None) is None:
        return {}
    return {"bias": PairBiases(module.gate_up_proj_bias, module.down_proj_bias, ids.flatten())}


def carry_biases(old: nn.Module, new: nn.Module) -> None:
    """Give `new`, which replaces the `Experts` `old` (offloaded or laid out otherwise), parameters like `old`'s
    biases (same shape, dtype and device), or None where it has none."""
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        bias = getattr(old, name, None)
        setattr(new, name, None if bias is None else nn.Parameter(torch.empty_like(bias), requires_grad=False))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, act: str = "silu", bias: bool = False) -> None:
        """`act`: the gated activation (a key of `GLUS`); `bias`: per-expert biases on gate_up and down."""
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.act_name, self.glu = act, GLUS[act]
        silu = act == "silu"
        self.decode = decode_reference if silu else partial(decode_reference, glu=self.glu)
        self.prefill: Callable = prefill_reference if silu else partial(prefill_reference, glu=self.glu)

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.grouped_gemm import grouped_gemm
        from edgemoe.kernels.moe_gemv import ACTS, fused_experts

        if self.act_name not in ACTS:  # an activation the kernels do not compute (Gemma-4's GELU)
            return
        self.decode = partial(fused_experts, act=self.act_name)  # reads the chosen experts in place
        self.prefill = partial(grouped_gemm, act=self.act_name)  # every pair in two launches, no host sync

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]; ids, weights: [tokens, top_k]
        bias = pair_biases(self, ids)
        if not get_context().is_prefill:  # sync-free, graph-capturable
            return self.decode(x, ids, weights, self.gate_up_proj, self.down_proj, **bias)
        return self.prefill(x, ids, weights, self.gate_up_proj, self.down_proj, **bias)


def decode_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    arrivals=None,  # noqa: ANN001 - the kernel's signature; the copy is done when this runs
    glu: Glu = silu_glu,
    bias: PairBiases | None = None,
) -> torch.Tensor:
    """Decode's routed experts in plain torch (`gathered_experts`; the copy is done when `arrivals` is given), with
    the signature of their kernel `edgemoe.kernels.moe_gemv.fused_experts`. Fixed shapes, no host synchronisation."""
    return gathered_experts(x, ids, weights, w13, w2, glu, bias)


def prefill_reference(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    glu: Glu = silu_glu, bias: PairBiases | None = None,
) -> torch.Tensor:  # fmt: skip
    """Prefill's routed experts in plain torch, with the signature of their kernel
    `edgemoe.kernels.grouped_gemm.grouped_gemm`: `pair_outputs_reference`, each token's pairs summed as the kernel
    sums them (`sum_pairs`)."""
    y = pair_outputs_reference(x, ids.flatten(), weights.flatten(), w13, w2, glu=glu, bias=bias)
    return sum_pairs(y, ids.shape[1])


def pair_outputs_reference(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
    glu: Glu = silu_glu,
    dense13: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
    dense2: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
    bias: PairBiases | None = None,
) -> torch.Tensor:
    """`edgemoe.kernels.grouped_gemm.pair_outputs` in plain torch: x [T, H]; rows [T * K] the bank row of each pair
    (-1: skipped, its row of `out` untouched); weights [T * K] -> out [T * K, H], each pair's expert output times its
    weight. One pair of matmuls per bank row over all of its pairs, so a row's pairs come out bitwise the same
    whichever other rows a call computes: waves of experts (offloaded prefill) equal one call. `dense13`, `dense2`:
    a layout's dequantization of a bank row (quantized experts); `bias`: the pairs' expert biases."""
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
        if bias is None:
            gate, up = F.linear(x[pairs // K], dense13(w13[row])).chunk(2, dim=-1)
            out[pairs] = F.linear(glu(gate, up), dense2(w2[row])) * weights[pairs, None]
        else:  # the pairs of one row share an expert: its biases
            e = bias.experts[pairs[:1]]
            gate, up = F.linear(x[pairs // K], dense13(w13[row]), bias.gate_up[e][0]).chunk(2, dim=-1)
            out[pairs] = F.linear(glu(gate, up), dense2(w2[row]), bias.down[e][0]) * weights[pairs, None]
        start += n
    return out


def sum_pairs(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y: [T * K, H] pair outputs -> [T, H]: each token's K rows summed in fp32 (a fixed order), rounded once."""
    return y.view(-1, top_k, y.shape[-1]).sum(dim=1, dtype=torch.float32).to(y.dtype)


def gathered_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    glu: Glu = silu_glu, bias: PairBiases | None = None,
) -> torch.Tensor:  # fmt: skip
    """One batched matmul over the (token, expert) pairs, with the pairs' weights gathered.

    Fixed shapes and no host synchronisation (decode, CUDA graphs); costs a copy of each chosen expert,
    so it is used only when there are few pairs.
    """
    tokens, top_k = ids.shape
    flat = ids.flatten()
    xs = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [pairs, hidden, 1]
    gate_up = torch.bmm(w13[flat], xs)[:, :, 0]  # [pairs, 2 * inter]
    if bias is not None:
        gate_up = gate_up + bias.gate_up[bias.experts]
    h = glu(*gate_up.chunk(2, dim=-1))[:, :, None]  # [pairs, inter, 1]
    out = torch.bmm(w2[flat], h)[:, :, 0]  # [pairs, hidden]
    if bias is not None:
        out = out + bias.down[bias.experts]
    return (out.view(tokens, top_k, -1) * weights[:, :, None]).sum(dim=1)
