"""Scheduling must never change results: chunked prefill, one-at-a-time, a KV cache small enough to
force preemption all give the same greedy tokens; blocks are all returned at the end."""

from __future__ import annotations

import pytest

from edgemoe import LLM, SamplingParams
from edgemoe.engine.kv_cache import bytes_per_block
from edgemoe.errors import EdgeMoEError

PROMPTS = [
    "ROMEO.\n",
    "Of Man's first disobedience, and the Fruit\nOf that Forbidden Tree",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "KING.",
]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(demo_llm) -> list[list[int]]:
    return [demo_llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=5),  # every prompt chunked
        dict(max_num_seqs=1),  # strictly one at a time
        dict(max_num_seqs=3, max_num_batched_tokens=9),
        dict(kv_cache_memory=6 * 16 * 2 * 7 * 4 * 32 * 4, block_size=16),  # 6 blocks: forces preemption
        dict(block_size=1),
    ],
)
def test_scheduling_does_not_change_tokens(reference, options) -> None:
    llm = LLM(progress=False, **options)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.kv.num_free == llm.engine.kv.num_blocks
    assert not llm.engine.has_unfinished()


def test_preemption_really_happens(monkeypatch) -> None:
    llm = LLM(progress=False, kv_cache_memory=6 * 16 * 2 * 7 * 4 * 32 * 4)
    assert llm.engine.kv.num_blocks == 6
    calls = []
    original = llm.engine.scheduler.preempt
    monkeypatch.setattr(llm.engine.scheduler, "preempt", lambda s: (calls.append(s.seq_id), original(s)))
    llm.generate(PROMPTS, GREEDY)
    assert calls


def test_kv_budget_sizing(demo_llm) -> None:
    cfg = demo_llm.engine.model_config
    per_block = bytes_per_block(cfg, 16, demo_llm.engine.dtype)
    llm = LLM(progress=False, kv_cache_memory="1MiB")
    assert llm.engine.kv.num_blocks == (1 << 20) // per_block
    with pytest.raises(EdgeMoEError, match="holds no KV block"):
        LLM(progress=False, kv_cache_memory="10")
    with pytest.raises(EdgeMoEError, match="does not fit the KV cache"):
        llm.generate("x" * 10, SamplingParams(max_tokens=5000))


def test_stop_conditions(demo_llm) -> None:
    full = demo_llm.generate("ROMEO.\n", GREEDY)[0].text
    word = full.split()[3]
    out = demo_llm.generate("ROMEO.\n", SamplingParams(max_tokens=40, temperature=0, stop=[word]))[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(word)]
    ids = demo_llm.generate("ROMEO.\n", GREEDY)[0].token_ids
    out = demo_llm.generate("ROMEO.\n", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[5]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[: ids.index(ids[5]) + 1]
    out = demo_llm.generate("ROMEO.\n", SamplingParams(max_tokens=7, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_streamed_deltas_equal_text_and_hold_back_stop_strings(demo_llm) -> None:
    full = demo_llm.generate("ROMEO.\n", GREEDY)[0].text
    stop = full[20:26]
    deltas = [o.delta for o in demo_llm.stream("ROMEO.\n", SamplingParams(max_tokens=40, temperature=0, stop=stop))]
    assert "".join(deltas) == full[: full.index(stop)]
    assert all(stop not in d for d in deltas)
    deltas = [o.delta for o in demo_llm.stream("ROMEO.\n", GREEDY)]
    assert "".join(deltas) == full and len([d for d in deltas if d]) > 10


def test_max_model_len(demo_llm) -> None:
    llm = LLM(progress=False, max_model_len=24)
    out = llm.generate("ROMEO.\n", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 24
    with pytest.raises(EdgeMoEError, match="context limit"):
        llm.generate("word " * 40, GREEDY)


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2.0),
        dict(stop=[""]),
    ],
)
def test_bad_sampling_params(bad) -> None:
    with pytest.raises(EdgeMoEError):
        SamplingParams(**bad)


def test_bad_prompts(demo_llm) -> None:
    for prompt in ([], [-1], [10**6], ""):
        with pytest.raises(EdgeMoEError):
            demo_llm.generate([prompt] if isinstance(prompt, list) else prompt, GREEDY)
    assert not demo_llm.engine.has_unfinished()


def test_long_prompt_starts_while_others_decode() -> None:
    """A prompt longer than the prefill budget is chunked in beside running requests, not starved."""
    engine = LLM(progress=False, max_num_batched_tokens=8).engine
    first = engine.add_request("ROMEO.\n", SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while first.num_uncomputed != 1:
        engine.step()
    long = engine.add_request("word " * 40, SamplingParams(max_tokens=4, temperature=0))
    for _ in range(3):
        engine.step()
    assert long.num_computed > 0 and first.finish_reason is None
    while engine.has_unfinished():
        engine.step()
    assert len(long.output_ids) == 4 and len(first.output_ids) == 60


def test_a_long_prefill_interleaves_with_running_decodes() -> None:
    """A prompt of many chunks admitted while a sequence decodes: the decoding sequence gets a token after every
    chunk, not after the whole prompt, and its greedy tokens are the same as alone."""
    from edgemoe import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = LLM(progress=False).generate(["ROMEO."], greedy)[0].token_ids
    engine = LLM(progress=False, max_num_batched_tokens=32).engine
    engine.add_request("ROMEO.", greedy, request_id="short")
    engine.step()  # its prefill
    engine.add_request(list(range(5, 5 + 200)), SamplingParams(max_tokens=2, temperature=0), request_id="long")
    kinds, short = [], []
    while engine.has_unfinished():
        outputs = engine.step()
        kinds.append([o.request_id for o in outputs])
        short += [o for o in outputs if o.request_id == "short"]
    prefill_steps = -(-200 // 32)
    gaps, gap = [], 0
    for step in kinds:
        if "short" in step:
            gaps.append(gap)
            gap = 0
        else:
            gap += 1
    assert max(gaps) <= 1, gaps  # at most one prefill chunk between two of its tokens
    assert len(kinds) >= prefill_steps and short[-1].token_ids == alone
