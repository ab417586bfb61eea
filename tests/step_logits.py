"""A test helper: every logits row an engine computes, keyed by the tokens its sequence held at that step, so that two
runs of the same requests compare step by step (a greedy token that flips shows up as keys one run has and the other
lacks)."""

from __future__ import annotations

import torch

from edgemoe import LLM


def record_step_logits(llm: LLM) -> dict[tuple[int, ...], torch.Tensor]:
    """From now on, each step's logits of `llm` (float32, on the CPU) land in the returned dict."""
    runner, seen = llm.engine.runner, {}
    compute = runner.compute_logits

    def record(batch):  # noqa: ANN001, ANN202 - the runner's signature
        due, logits = compute(batch)
        if logits is not None:
            for i, row in zip(due, logits):
                seen[tuple(batch.seqs[i].token_ids)] = row.float().cpu()
        return due, logits

    runner.compute_logits = record
    return seen
