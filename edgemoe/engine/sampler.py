"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

No host synchronisation: filters are masks built on the device, and a token is drawn as the argmax of
probs / Exponential(1) noise (equivalent to sampling from probs), the noise coming from each request's
own generator so that a seeded request gives the same text whatever it is batched with.
"""

from __future__ import annotations

import torch


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """logits [seqs, vocab] float32; per-row params [seqs] -> probabilities with filtered tokens at 0."""
    logits = logits / temperature.clamp_min(1e-6)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    drop = rank >= k
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p is kept)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits).softmax(dim=-1)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        generators: list[torch.Generator],
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if all(g is None for g in generators):
            return greedy
        probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
        noise = torch.stack(
            [
                torch.empty(logits.shape[-1], device=logits.device).exponential_(generator=g)
                if g is not None
                else torch.ones(logits.shape[-1], device=logits.device)
                for g in generators
            ]
        )
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature == 0, greedy, sampled)
