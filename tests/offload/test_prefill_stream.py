"""Streamed prefill (`edgemoe.offload.prefill_stream`) on the CPU: every prefill and decode step's logits bitwise equal
to resident experts over several chunks and requests (decode steps in between evict what the areas held); the cache's
mapping after a prefill against a plain-Python model of what the streamer does; which caches stream."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.offload.prefill_stream import PrefillStream
from edgemoe.tools.make_model import make_model
from tests.step_logits import record_step_logits

E, LAYERS = 8, 3  # the tiny preset: 8 experts a layer, 3 MoE layers
PROMPTS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "Of Man's first disobedience, and the fruit of that forbidden tree",
    "Now is the winter of our discontent",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("stream"), "qwen3_moe", "tiny", dtype="float32", seed=3))


def step_logits(llm: LLM, prompts: list[str]) -> dict[tuple[int, ...], torch.Tensor]:
    """Greedy generation, each prompt alone then all together -> {tokens a sequence held at a step: its logits}."""
    seen = record_step_logits(llm)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for p in prompts:  # one after another: the second request's prefill meets what decode left in the cache
        llm.generate(p, params)
    llm.generate(prompts, params)  # together, in chunks of 16 tokens
    return seen


def assert_streamed_is_resident(folder: str, monkeypatch, slots: int, **engine) -> LLM:  # noqa: ANN001
    """Every step's logits with streamed prefill (a cache of `slots`) bitwise those of resident experts; the
    streaming LLM. `engine`: the rest of both engines' options."""
    calls = []
    original = PrefillStream.run

    def spy(self, layer, *args):  # noqa: ANN001, ANN202
        calls.append(layer)
        return original(self, layer, *args)

    monkeypatch.setattr(PrefillStream, "run", spy)
    common = dict(progress=False, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16, **engine)
    want = step_logits(LLM(folder, **common), PROMPTS)
    llm = LLM(folder, moe_strategy="offload", moe_cache_slots=slots, **common)
    assert llm.engine.expert_cache.prefill_stream is not None
    got = step_logits(llm, PROMPTS)
    layers = len(llm.engine.expert_cache.prefill_stream.banks)
    assert calls[:layers] == list(range(layers)), "prefill did not stream every MoE layer in order"
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"logits differ at {len(key)} tokens"
    return llm


@pytest.mark.parametrize("policy", ["lru", "scored"])
def test_streamed_prefill_is_bitwise_resident(folder: str, policy: str, monkeypatch) -> None:
    llm = assert_streamed_is_resident(folder, monkeypatch, 2 * E + 1, moe_policy=policy)
    cache = llm.engine.expert_cache
    owner, slot_of = cache.owner[:-1].tolist(), cache.slot_of[:-1].tolist()
    assert all(owner[s] == k for k, s in enumerate(slot_of) if s >= 0)
    assert all(slot_of[k] == s for s, k in enumerate(owner) if k >= 0)


def test_mapping_after_one_prefill(folder: str) -> None:
    """A fresh cache after one streamed prefill, against what the streamer is meant to leave: the last two layers'
    experts in their areas (layer l in slots (l % 2) * E + e), nothing else, and per layer E accesses and misses."""
    llm = LLM(folder, moe_strategy="offload", moe_cache_slots=2 * E + 2, moe_collect_stats=True, progress=False,
              max_num_seqs=1, max_model_len=256)  # fmt: skip
    cache = llm.engine.expert_cache
    cache.reset()
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=1))  # the prefill only (its one token comes from it)
    expected = {}
    for layer in (LAYERS - 2, LAYERS - 1):
        for e in range(E):
            expected[layer * E + e] = (layer % 2) * E + e
    slot_of = cache.slot_of[:-1].tolist()
    assert {k: s for k, s in enumerate(slot_of) if s >= 0} == expected
    stats = cache.stats.tolist()
    assert [row[:3] for row in stats] == [[E, 0, E]] * LAYERS
    assert [row[4] for row in stats] == [E * cache.expert_bytes] * LAYERS


@pytest.mark.parametrize(
    ("slots", "streams"), [(2 * E - 1, False), (2 * E, True), (LAYERS * E - 1, True), (LAYERS * E, False)]
)
def test_which_caches_stream(folder: str, slots: int, streams: bool) -> None:
    llm = LLM(folder, moe_strategy="offload", moe_cache_slots=slots, progress=False, max_num_seqs=1, max_model_len=64)
    assert (llm.engine.expert_cache.prefill_stream is not None) == streams
