"""Sampler filters against a plain-Python reference, and draws against the filtered distribution."""

from __future__ import annotations

import math
import random

import torch

from edgemoe.engine.sampler import Sampler, filtered_probs


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    exp = [math.exp(x - m) for x in scaled]
    total = sum(exp)
    probs = [e / total for e in exp]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for rank, i in enumerate(order):
        if rank > 0 and ((top_k > 0 and rank >= top_k) or mass >= top_p or probs[i] < min_p * probs[order[0]]):
            continue
        keep.add(i)
        mass += probs[i]
    kept = sum(exp[i] for i in keep)
    return [exp[i] / kept if i in keep else 0.0 for i in range(len(probs))]


def test_filtered_probs_match_reference() -> None:
    rng = random.Random(0)
    for _ in range(40):
        vocab = rng.randint(2, 50)
        rows = [[rng.gauss(0, 3) for _ in range(vocab)] for _ in range(4)]
        params = [
            (
                rng.choice([0.3, 1.0, 1.7]),
                rng.choice([-1, 0, 1, 3, 10]),
                rng.choice([1.0, 0.9, 0.5, 0.05]),
                rng.choice([0.0, 0.05, 0.3]),
            )
            for _ in rows
        ]
        got = filtered_probs(torch.tensor(rows), *(torch.tensor(col) for col in zip(*params)))
        for row, p, g in zip(rows, params, got.tolist()):
            ref = reference_probs(row, *p)
            assert all(abs(a - b) < 1e-5 for a, b in zip(ref, g)), (p, ref, g)


def test_draws_follow_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    args = (torch.tensor([1.0]), torch.tensor([4]), torch.tensor([0.95]), torch.tensor([0.0]))
    probs = filtered_probs(logits, *args)[0]
    gen = torch.Generator().manual_seed(123)
    n = 4000
    counts = torch.zeros(6)
    for _ in range(n):
        counts[Sampler()(logits, *args, [gen])[0]] += 1
    assert counts[4:].sum() == 0  # filtered by top-k
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_greedy_rows_unaffected_by_sampled_rows() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    gens = [None, torch.Generator().manual_seed(1), None]
    temps = torch.tensor([0.0, 1.0, 0.0])
    out = Sampler()(logits, temps, torch.tensor([-1, -1, -1]), torch.ones(3), torch.zeros(3), gens)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
