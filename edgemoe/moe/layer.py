from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.engine.context import get_context
from edgemoe.layers.mlp import GatedMLP
from edgemoe.moe.experts import Experts
from edgemoe.moe.router import route


class SparseMoE(nn.Module):
    """Router + routed experts (+ a sigmoid-gated shared expert where the family has one)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]
        ids, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        valid = get_context().valid
        if valid is not None:  # padding rows reuse row 0's experts: no extra fetches, no extra counts
            ids = torch.where(valid[:, None], ids, ids[:1])
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
