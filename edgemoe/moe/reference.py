"""Plain-torch reference of a sparse MoE block: one token, one expert at a time. Tests only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  normalize: bool) -> torch.Tensor:
    """x: [tokens, hidden], gate: [experts, hidden], banks as in `Experts` -> [tokens, hidden]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax((gate @ x[t]).double(), dim=-1)
        top = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e].item() for e in top) if normalize else 1.0
        for e in top:
            gate_h, up_h = (w13[e] @ x[t]).chunk(2)
            out[t] += (probs[e].item() / total) * (w2[e] @ (F.silu(gate_h) * up_h))
    return out
