"""Constrained decoding (`SamplingParams.grammar`, llguidance): every sampled output follows its grammar and ends
where the grammar may; a grammar that allows everything changes nothing; a bad grammar is one `EdgeMoEError`."""

from __future__ import annotations

import json

import pytest
import torch

from edgemoe import SamplingParams
from edgemoe.engine.grammar import GrammarConstraint
from edgemoe.errors import EdgeMoEError

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
          "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
JSON = "start: %json " + json.dumps(SCHEMA)


def test_sampled_outputs_follow_the_schema(demo_llm):
    """The demo model writes plays, not JSON: unconstrained, no output parses."""
    outs = demo_llm.generate(["ROMEO:"] * 6, SamplingParams(max_tokens=64, temperature=1.0, grammar=JSON))
    for out in outs:
        value = json.loads(out.text)
        assert value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 9 and set(value) == {"city", "days"}
        assert out.finish_reason == "stop" and out.stop_reason is None  # the grammar ended: only a stop token
    free = demo_llm.generate("ROMEO:", SamplingParams(max_tokens=64, temperature=1.0, seed=0))[0].text
    with pytest.raises(ValueError):
        json.loads(free)


def test_a_grammar_that_allows_everything_changes_nothing(demo_llm):
    prompts = ["ROMEO:", "To be, or not"]
    free = demo_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    any_text = demo_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, grammar="start: /(.|\\n)*/"))
    assert [o.token_ids for o in any_text] == [o.token_ids for o in free]


def test_a_bad_grammar(demo_llm):
    with pytest.raises(EdgeMoEError, match="grammar"):
        demo_llm.generate("ROMEO:", SamplingParams(grammar="start: undefined_rule"))
    with pytest.raises(EdgeMoEError, match="grammar must be a string"):
        SamplingParams(grammar=3)


def test_packed_masks_unpack_bit_by_bit() -> None:
    """`_penalties` against reading each token's bit of its word (token t: bit t % 32 of word t // 32, sign bit too),
    on random words: 0 where the bit is set, -inf elsewhere."""
    g = torch.Generator().manual_seed(3)
    masks = torch.randint(-(2**31), 2**31, (3, 5), generator=g, dtype=torch.int64).to(torch.int32)
    constraint = GrammarConstraint.__new__(GrammarConstraint)
    constraint._tables = {}
    got = constraint._penalties(masks, torch.float32)
    bits = torch.tensor([[(int(masks[r, t // 32]) >> (t % 32)) & 1 for t in range(160)] for r in range(3)]).bool()
    assert torch.equal(got, torch.zeros(3, 160).masked_fill(~bits, float("-inf")))
