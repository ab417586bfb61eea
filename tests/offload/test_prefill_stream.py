"""Streamed prefill (`edgemoe.offload.prefill_stream`) on the CPU: every prefill and decode step's logits bitwise equal
to resident experts over several chunks and requests (decode steps in between evict what the areas held); the cache's
mapping after a prefill against a plain-Python model of what the streamer does; which caches stream; which steps
stream (a step whose experts are mostly cached goes in waves), against a plain-Python count of its misses."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.offload.prefill_stream import STREAM_FROM, PrefillStream
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


def test_mostly_cached_steps_go_in_waves(folder: str, monkeypatch) -> None:
    """A cache one expert short of all: the first prefill (cold) streams, later ones find most experts cached and go
    in waves, every step's logits still bitwise resident experts'."""
    chosen = []
    original = PrefillStream.chooses

    def spy(self, layer, ids):  # noqa: ANN001, ANN202
        chosen.append((layer, original(self, layer, ids)))
        return chosen[-1][1]

    monkeypatch.setattr(PrefillStream, "chooses", spy)
    assert_streamed_is_resident(folder, monkeypatch, LAYERS * E - 1)
    steps = [streams for layer, streams in chosen if layer == 0]
    assert steps[0] and not all(steps), steps
    assert all(streams == steps[i // LAYERS] for i, (_, streams) in enumerate(chosen)), "a step changed its mind"


def test_expected_misses_against_a_plain_count(folder: str) -> None:
    """`expected_misses` and the choice against plain Python over the cache's mapping, for random routings of
    MoE layer 0, on the cache as a few requests left it (some layers whole, some partly cached)."""
    llm = LLM(folder, moe_strategy="offload", moe_cache_slots=2 * E + 3, progress=False, max_num_seqs=1,
              max_model_len=256)  # fmt: skip
    for prompt in PROMPTS:
        llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    stream = llm.engine.expert_cache.prefill_stream
    slot_of = llm.engine.expert_cache.slot_of.tolist()
    absent = [[slot_of[layer * E + e] < 0 for e in range(E)] for layer in range(LAYERS)]
    assert 0 < sum(map(sum, absent)) < LAYERS * E  # partly cached
    gen = torch.Generator().manual_seed(7)
    for tokens in (1, 2, 5, 40):
        ids = torch.randint(0, E, (tokens, 2), generator=gen)
        used = set(ids.flatten().tolist())
        want = sum(absent[0][e] for e in used) + len(used) * sum(map(sum, absent[1:])) / E
        assert stream.expected_misses(ids) == pytest.approx(want)
        assert stream.chooses(0, ids) == (want > STREAM_FROM * LAYERS * E)
        assert stream.chooses(1, ids) == (want > STREAM_FROM * LAYERS * E)  # kept for the step's later layers
    llm.engine.expert_cache.reset()  # nothing cached: a step using most experts streams, one using few does not
    for tokens, streams in ((40, True), (1, False)):
        ids = torch.randint(0, E, (tokens, 2), generator=gen)
        used = len(set(ids.flatten().tolist()))
        assert stream.expected_misses(ids) == pytest.approx(used * LAYERS)
        assert stream.chooses(0, ids) is streams and stream.chooses(2, ids) is streams
