"""Routing: a MoE block's gate logits -> each token's top-k experts and their weights. Plain torch, fixed shapes and no
host synchronisation, so decode can run them inside CUDA graphs; `edgemoe.kernels.router` fuses `route` for decode."""

from __future__ import annotations

import torch


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, softmax_after_top_k: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, keep the top k, optionally renormalise them to sum to 1; or, with
    `softmax_after_top_k` (gpt-oss), keep the top k logits and softmax over them alone (`normalize` then moot).

    logits: [tokens, experts] -> (ids [tokens, top_k] int64, weights [tokens, top_k] in logits' dtype)
    """
    if softmax_after_top_k:
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1).to(logits.dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a correction bias and group limits (GLM-4.5, DeepSeek-V3), in float32.

    Each expert scores sigmoid(logit). The learnt `bias` [experts] steers only which experts are chosen (it balances
    their load), never how much they weigh: the experts are split into `n_group` groups of consecutive ids, a group
    is worth the sum of its two best biased scores, the `topk_group` best groups stay in play and the top k biased
    scores among their experts are chosen. Their weights are the plain scores, optionally renormalised to sum to 1,
    times `scale` (the routed scaling factor).

    logits: [tokens, experts] -> (ids [tokens, top_k] int64, weights [tokens, top_k] float32)
    """
    scores = torch.sigmoid(logits.float())  # [tokens, experts]
    choice = scores + bias.float()
    if topk_group < n_group:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        worth = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [tokens, n_group]
        kept = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, worth.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(tokens, experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' guard against 0 / 0
    return ids, weights * scale
