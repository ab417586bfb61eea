from __future__ import annotations

import torch


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, keep the top k, optionally renormalise them to sum to 1.

    logits: [tokens, experts] -> (ids [tokens, top_k] int64, weights [tokens, top_k] in logits' dtype)
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)
