"""`LLMEngine.logits_processors` act before the sampler (greedy and sampled rows alike); outputs say which stop
string ended them; `skip_special_tokens=False` keeps special tokens in the text."""

from __future__ import annotations

import torch

from edgemoe import SamplingParams
from edgemoe.engine.sequence import Sequence


class Force:
    """Make every sequence say `ids`, then the end of the turn."""

    def __init__(self, ids: list[int], end: int) -> None:
        self.ids, self.end, self.seen = ids, end, 0

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        self.seen += len(seqs)
        for row, seq in enumerate(seqs):
            step = len(seq.output_ids)
            logits[row] = float("-inf")
            logits[row, self.ids[step] if step < len(self.ids) else self.end] = 0.0
        return logits


def test_processor_forces_text_through_sampler_and_detokenizer(demo_llm):
    tok, engine = demo_llm.tokenizer, demo_llm.engine
    text = "<|im_start|>Thou art a villain."
    force = Force(tok.encode(text, add_special_tokens=False), tok.encode("<|im_end|>", add_special_tokens=False)[0])
    engine.logits_processors.append(force)
    try:
        greedy = demo_llm.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=64, temperature=0))
        sampled = demo_llm.generate("ROMEO:", SamplingParams(max_tokens=64, temperature=1.0, seed=3))
        assert [o.text for o in greedy + sampled] == ["Thou art a villain."] * 3  # special tokens skipped
        assert all(o.finish_reason == "stop" and o.stop_reason is None for o in greedy + sampled)  # the end token
        kept = demo_llm.generate("ROMEO:", SamplingParams(max_tokens=64, skip_special_tokens=False))[0]
        assert kept.text == text
        cut = demo_llm.generate("ROMEO:", SamplingParams(max_tokens=64, stop=["villain", "art"]))[0]
        assert (cut.text, cut.finish_reason, cut.stop_reason) == ("Thou ", "stop", "art")
        assert force.seen > 0
    finally:
        engine.logits_processors.remove(force)
    assert demo_llm.generate("ROMEO:", SamplingParams(max_tokens=8, temperature=0))[0].text != "Thou art a villain."
