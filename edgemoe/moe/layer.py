from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.engine.context import get_context
from edgemoe.layers.mlp import GatedMLP
from edgemoe.layers.norm import RMSNorm
from edgemoe.moe.experts import Experts
from edgemoe.moe.router import route


class SparseMoE(nn.Module):
    """Router + routed experts (+ a sigmoid-gated shared expert where the family has one).

    With a `side_stream` (CUDA, `set_shared_expert_stream`), the shared expert and its gate run there, forked once
    the layer input is ready and joined before the sum, so they overlap the routed experts' router, ensure, miss
    copy and GEMVs on the current stream (forking later, just before the copy, measured slower on the H200:
    benchmarks/RESULTS.md). Same ops, same sum: outputs are bitwise equal with and without the side stream."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.side_stream: torch.cuda.Stream | None = None

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
        """Whether `add_norm_forward` can run `norm` inside the router: decode on CUDA, a row in one gate tile, one
        dtype for x and both weights."""
        if not x.is_cuda or get_context().is_prefill or len({x.dtype, self.gate.weight.dtype, norm.weight.dtype}) > 1:
            return False
        from edgemoe.kernels.router import MAX_NORM_HIDDEN  # CPU-only machines lack triton

        return x.shape[-1] <= MAX_NORM_HIDDEN

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, ...]:
        """`self(norm(x, residual))` with the residual add and the norm inside the router's gate GEMV (where
        `fuses_norm`): one launch fewer -> (this block's output, x + residual)."""
        from edgemoe.kernels.router import norm_route

        valid = get_context().valid
        xn, h, ids, weights = norm_route(
            x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.norm_topk_prob, valid
        )
        return self(xn, (ids, weights)), h

    def _routed(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if routing is not None:
            return self.experts(x, *routing)
        if x.is_cuda and not get_context().is_prefill:
            from edgemoe.kernels.router import fused_route  # CPU-only machines lack triton

            # decode: gate GEMV and routing, two launches instead of ~6 (softmax, top-k, cast, padding rows...)
            ids, weights = fused_route(x, self.gate.weight, self.top_k, self.norm_topk_prob, get_context().valid)
            return self.experts(x, ids, weights)
        ids, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        valid = get_context().valid
        if valid is not None:  # padding rows reuse row 0's experts: no extra fetches, no extra counts
            ids = torch.where(valid[:, None], ids, ids[:1])
        return self.experts(x, ids, weights)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def set_shared_expert_stream(model: nn.Module, stream: torch.cuda.Stream | None) -> int:
    """Run every shared expert of `model` on `stream` (None: inline). Returns how many layers have one."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE) and m.shared_expert is not None]
    for m in layers:
        m.side_stream = stream
    return len(layers)
