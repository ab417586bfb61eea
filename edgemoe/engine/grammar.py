"""Constrained decoding: a sequence whose `SamplingParams.grammar` is set samples only tokens that keep its output in
the grammar, and its stop token only where the grammar may end.

Grammars are llguidance's (Lark syntax, JSON schemas inline as `%json {...}`: docs/syntax.md of guidance-ai/llguidance),
chosen over xgrammar for its wheel without dependencies and its tokenizer built from the `tokenizer.json` the engine
already reads. `GrammarConstraint` is a logits processor (`LLMEngine.logits_processors`): at each step, each
constrained sequence's matcher takes the tokens sampled since its last mask and writes the next mask (a bit per
token, on the host; llguidance lets go of the GIL), and the masks go to the step's logits in one op.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import llguidance
import torch

from edgemoe.engine.sequence import Sequence
from edgemoe.errors import EdgeMoEError
from edgemoe.tokenizer import Tokenizer


@dataclass
class _Matched:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has taken


class GrammarConstraint:
    """The grammars of the sequences that have one, applied as a mask."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        """`vocab_size`: the model's (the logits' width, which may pass the tokenizer's); `stop_ids`: the tokens
        that end a sequence, allowed where the grammar may end."""
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)
        self._stop = torch.zeros(self._words, dtype=torch.int32)  # the mask that allows only the stop tokens
        for t in stop_ids:
            self._stop[t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)
        self._matched: weakref.WeakKeyDictionary[Sequence, _Matched] = weakref.WeakKeyDictionary()

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher of `grammar`, checked: an `EdgeMoEError` says what is wrong with it."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise EdgeMoEError(f"grammar: {matcher.get_error()}")
        return matcher

    def attach(self, seq: Sequence, matcher: llguidance.LLMatcher) -> None:
        self._matched[seq] = _Matched(matcher)

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        rows = [(row, seq, m) for row, seq in enumerate(seqs) if (m := self._matched.get(seq)) is not None]
        if not rows:
            return logits
        masks = torch.zeros(len(rows), self._words, dtype=torch.int32)  # [rows, vocab / 32], a bit per token
        for i, (_, seq, m) in enumerate(rows):
            new = seq.output_ids[m.consumed :]
            m.consumed += len(new)
            if m.matcher.is_error() or (new and not m.matcher.consume_tokens(new)):
                masks[i] = self._stop  # a token the grammar refused (another processor chose it): end there
            else:
                m.matcher.unsafe_compute_mask_ptr(masks[i].data_ptr(), self._words * 4)
        allowed = ((masks.unsqueeze(-1) >> self._bits) & 1).reshape(len(rows), -1)[:, : logits.shape[1]].bool()
        index = torch.tensor([row for row, _, _ in rows], device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits
