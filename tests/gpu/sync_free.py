"""Decode steps under `torch.cuda.set_sync_debug_mode("error")`: torch raises on any host synchronisation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def host_sync_forbidden() -> Iterator[None]:
    """Inside: torch raises on any host synchronisation (`torch.cuda.set_sync_debug_mode("error")`)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def decode_without_sync(engine, sample: Callable[[object, list[int], torch.Tensor], torch.Tensor]) -> int:
    """Run `engine`'s remaining decode steps (prefill must be done) with host syncs forbidden around the logits and
    `sample(batch, due, logits) -> token ids`; reading the ids afterwards is the step's one allowed sync. Returns
    the number of steps."""
    steps = 0
    while engine.has_unfinished():
        batch = engine.scheduler.schedule()
        assert not batch.is_prefill
        torch.cuda.synchronize()
        with host_sync_forbidden():
            due, logits = engine.runner.compute_logits(batch)
            tokens = sample(batch, due, logits)
        for seq, n, tok in zip(batch.seqs, batch.num_new, tokens.tolist()):
            seq.num_computed += n
            engine._append(seq, tok)
            if seq.finish_reason:
                engine.scheduler.finish(seq)
        steps += 1
    return steps
