"""Speculative decoding's drafts from the checkpoint's multi-token-prediction head (`--speculative mtp`; the head:
`edgemoe.models.mtp`).

After every step the head runs at the positions each greedy sequence kept that step (a prefill chunk's, a decode
step's one, a verify step's accepted ones), from the decoder's final hidden states there and the token after each, so
that the head's KV cache covers the sequence as in training. A sequence that decodes next then chains the head from
its last position, k steps, one token each: the drafts its next step verifies (`edgemoe.engine.speculative`: drafts
decide what a step computes, never what it outputs). The chained steps write the head's K/V ahead, at positions the
sequence has not computed (blocks reserved where free, never preempting); the rows computed later overwrite them.

Cost per step: the head's layer (attention and routed experts, through the same expert cache as the decoder's) at the
kept positions, once more per drafted token after the first, and one host read of the drafts. Sampled sequences run
the head too (the prefix cache may hand their blocks to a greedy one) but draft nothing.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from edgemoe.engine.model_runner import ModelRunner
from edgemoe.engine.scheduler import Batch, Scheduler
from edgemoe.engine.sequence import Sequence


class MTPDrafter:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.drafts: weakref.WeakKeyDictionary[Sequence, list[int]] = weakref.WeakKeyDictionary()

    def draft(self, seq: Sequence, k: int) -> list[int]:
        """Up to k of the tokens the head drafted for `seq` after its last step (none: [])."""
        return self.drafts.pop(seq, [])[:k]

    def after_step(self, batch: Batch, starts: list[int], kept: list[int], room: Callable[[Sequence], int]) -> None:
        """After `batch` ran and its tokens were appended: the head at each sequence's kept[i] positions from
        starts[i]; then drafts for those that decode next, `room(seq)` tokens each (0: none). Every unfinished
        sequence, sampled ones too: the prefix cache may hand their blocks to later requests, the head's K/V
        included."""
        try:
            self._after_step(batch, starts, kept, room)
        finally:
            self.runner.hidden = None  # a prefill step's rows need not outlive it

    def _after_step(self, batch: Batch, starts: list[int], kept: list[int], room: Callable[[Sequence], int]) -> None:
        runner = self.runner
        offsets = list(itertools.accumulate(batch.num_new, initial=0))  # each sequence's first row in the step
        picked = [i for i, (seq, n) in enumerate(zip(batch.seqs, kept)) if n and not seq.finish_reason]
        for seq in batch.seqs:
            self.drafts.pop(seq, None)
        if not picked:
            return
        seqs = [batch.seqs[i] for i in picked]
        rows = [r for i in picked for r in range(offsets[i], offsets[i] + kept[i])]
        next_ids = [t for i in picked for t in batch.seqs[i].token_ids[starts[i] + 1 : starts[i] + kept[i] + 1]]
        ends = list(itertools.accumulate(kept[i] for i in picked))
        chained = [(j, seq, room(seq)) for j, seq in enumerate(seqs) if seq.num_uncomputed == 1]
        chained = [(j, seq, k) for j, seq, k in chained if k > 0]
        hidden, tokens = runner.mtp_forward(
            seqs,
            [starts[i] for i in picked],
            [kept[i] for i in picked],
            runner.hidden[runner.to_device(rows)],
            runner.to_device(next_ids),
            step=0,
            draft_rows=[ends[j] - 1 for j, _, _ in chained],
        )
        if not chained:
            return
        alive = list(range(len(chained)))  # chained sequences still drafting
        steps = [(alive, tokens)]
        hidden = hidden[runner.to_device([ends[j] - 1 for j, _, _ in chained])]
        for step in itertools.count(1):
            # chained row `step` sits at position num_computed - 1 + step: its block must exist
            going = [
                c
                for c in alive
                if chained[c][2] > step
                and self.scheduler.reserve(chained[c][1], chained[c][1].num_computed + step)
                >= chained[c][1].num_computed + step
            ]
            if not going:
                break
            keep = runner.to_device([alive.index(c) for c in going])
            going_seqs = [chained[c][1] for c in going]
            hidden, tokens = runner.mtp_forward(
                going_seqs,
                [seq.num_computed - 1 + step for seq in going_seqs],
                [1] * len(going),
                hidden[keep],
                tokens[keep],
                step=step,
                draft_rows=None,
            )
            alive = going
            steps.append((alive, tokens))
        drafted = iter(torch.cat([t for _, t in steps]).tolist())  # the drafts' one host read
        out: dict[int, list[int]] = {c: [] for c in range(len(chained))}
        for alive, _ in steps:
            for c in alive:
                out[c].append(next(drafted))
        for c, (_, seq, _) in enumerate(chained):
            self.drafts[seq] = out[c]
