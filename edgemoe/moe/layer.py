"""The sparse MoE block: router, routed experts, and the sigmoid-gated shared expert where a family has one."""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.context import get_context
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.mlp import GatedMLP
from edgemoe.layers.norm import RMSNorm
from edgemoe.moe.experts import Experts
from edgemoe.moe.router import route


class SparseMoE(nn.Module):
    """Router + routed experts (+ a sigmoid-gated shared expert where the family has one).

    With a `side_stream` (CUDA, `set_shared_expert_stream`), the shared expert and its gate run there, forked once
    the layer input is ready and joined before the sum, so they overlap the routed experts' router, ensure, miss
    copy and GEMVs on the current stream. Same ops, same sum: outputs are bitwise equal with and without it.

    `moe_layer`: this block's place among the model's MoE layers (the routing seam's row, the expert cache's layer)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        inter: int,
        norm_topk_prob: bool,
        moe_layer: int,
        shared: int = 0,
        act: str = "silu",
    ) -> None:
        """`act`: the routed experts' gate activation (`edgemoe.layers.mlp.ACTIVATIONS`)."""
        super().__init__()
        self.top_k, self.norm_topk_prob, self.moe_layer = top_k, norm_topk_prob, moe_layer
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter, act)
        self.shared_expert = self.shared_expert_gate = None
        if shared:
            self.shared_expert = GatedMLP(hidden, shared)
            self.shared_expert_gate = DecodeLinear(hidden, 1, bias=False)
        self.side_stream: torch.cuda.Stream | None = None
        self._fused_route = self._norm_route = None  # decode's router kernels, once `use_kernels` chose them

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.router import fused_route, norm_route

        self._fused_route, self._norm_route = fused_route, norm_route

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [tokens, hidden]; routing: (ids, weights) already chosen (`add_norm_forward`), else the router runs."""
        if self.shared_expert is None:
            return self._routed(x, routing)
        if self.side_stream is None:
            return self._routed(x, routing) + self._shared(x)
        main = torch.cuda.current_stream()
        self.side_stream.wait_stream(main)  # fork: x is ready
        with torch.cuda.stream(self.side_stream):
            shared = self._shared(x)
        routed = self._routed(x, routing)
        main.wait_stream(self.side_stream)  # join
        return routed + shared

    def fuses_norm(self, x: torch.Tensor, norm: RMSNorm) -> bool:
        """Whether `add_norm_forward` can run `norm` inside the router: decode with kernels, a row in one gate tile,
        one dtype for x and both weights."""
        if self._norm_route is None or get_context().is_prefill:
            return False
        from edgemoe.kernels.router import MAX_NORM_HIDDEN

        return len({x.dtype, self.gate.weight.dtype, norm.weight.dtype}) == 1 and x.shape[-1] <= MAX_NORM_HIDDEN

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, ...]:
        """`self(norm(x, residual))` with the residual add and the norm inside the router's gate GEMV (where
        `fuses_norm`): one launch fewer -> (this block's output, x + residual)."""
        valid = get_context().valid
        xn, h, ids, weights = self._norm_route(
            x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.norm_topk_prob, valid
        )
        return self(xn, (ids, weights)), h

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (ids, weights) [tokens, top_k]. Decode with kernels: the gate GEMV and the routing in
        two launches instead of ~6; padding rows reuse row 0's experts (no extra fetches, no extra counts)."""
        ctx = get_context()
        if self._fused_route is not None and not ctx.is_prefill:
            return self._fused_route(x, self.gate.weight, self.top_k, self.norm_topk_prob, ctx.valid)
        ids, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        if ctx.valid is not None:
            ids = torch.where(ctx.valid[:, None], ids, ids[:1])
        return ids, weights

    def routed(self, ids: torch.Tensor) -> torch.Tensor:
        """The routing seam: ids given from outside (`ForwardContext.forced_ids`, a trace) replace the router's, and
        the ids used are written out where the context asks (`routed_ids`). Views and one copy: graph-capturable."""
        ctx = get_context()
        if ctx.forced_ids is not None:
            ids = ctx.forced_ids[self.moe_layer]
        if ctx.routed_ids is not None and not ctx.is_prefill:
            ctx.routed_ids[self.moe_layer].copy_(ids)
        return ids

    def _routed(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        ids, weights = self.route(x) if routing is None else routing
        return self.experts(x, self.routed(ids), weights)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def set_shared_expert_stream(model: nn.Module, stream: torch.cuda.Stream | None) -> int:
    """Run every shared expert of `model` on `stream` (None: inline). Returns how many layers have one."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE) and m.shared_expert is not None]
    for m in layers:
        m.side_stream = stream
    return len(layers)
