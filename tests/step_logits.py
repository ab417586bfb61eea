"""A test helper: every logits row an engine computes, keyed by the tokens its sequence held at that step, so that two
runs of the same requests compare step by step (a greedy token that flips shows up as keys one run has and the other
lacks)."""

from __future__ import annotations

import torch

from edgemoe import LLM


def record_step_logits(llm: LLM) -> dict[tuple[int, ...], torch.Tensor]:
    """From now on, each step's logits of `llm` (float32, on the CPU) land in the returned dict, tapped through the
    engine's logits processors (which change nothing here)."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}

    def record(seqs, logits: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - sequences due a token
        for seq, row in zip(seqs, logits):
            seen[tuple(seq.token_ids)] = row.float().cpu()
        return logits

    llm.engine.logits_processors.append(record)
    return seen
