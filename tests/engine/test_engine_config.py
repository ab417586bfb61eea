"""Engine settings a user gets wrong or leaves at their defaults: every bad value an `EdgeMoEError` before anything
loads, the KV cache sized as documented and said in one line, unseeded sampling different per engine, and greedy
logits of one request independent of the KV-cache size, max_num_seqs and (on the CPU) max_model_len."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.config import engine_config
from edgemoe.errors import EdgeMoEError

PER_BLOCK = 2 * 7 * 16 * 4 * 32 * 4  # the demo model's KV block in float32: layers, tokens, kv heads, head_dim


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_model_len=0), "max_model_len must be an integer >= 1, got 0"),
        (dict(max_model_len=-5), "max_model_len must be an integer >= 1, got -5"),
        (dict(max_model_len="2048"), "max_model_len must be an integer >= 1"),
        (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
        (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be an integer >= 1"),
        (dict(block_size=True), "block_size must be an integer >= 1"),
        (dict(kv_cache_tokens=0), "kv_cache_tokens must be an integer >= 1"),
        (dict(kv_cache_memory="lots"), "cannot read size"),
        (dict(kv_cache_memory="1MiB", kv_cache_tokens=64), "give one of kv_cache_memory and kv_cache_tokens"),
        (dict(seed="7"), "seed must be an integer or None"),
    ],
)
def test_bad_engine_values(kwargs: dict, message: str) -> None:
    with pytest.raises(EdgeMoEError, match=message.replace("(", r"\(")):
        engine_config(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(top_p=None), "top_p must be a number"),
        (dict(max_tokens=True), "max_tokens must be an integer"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids must be a list of integers"),
        (dict(seed=2**64), "seed must be an integer in"),
    ],
)
def test_bad_sampling_values(kwargs: dict, message: str) -> None:
    with pytest.raises(EdgeMoEError, match=message):
        SamplingParams(**kwargs)


def test_kv_cache_sizes_and_says_so(capfd) -> None:
    llm = LLM(progress=False, max_model_len=100)  # auto: 8 sequences of 100 tokens, 7 blocks each
    assert llm.engine.kv.num_blocks == 8 * 7
    assert "edgemoe: KV cache: 896 tokens, " in capfd.readouterr().err
    llm = LLM(progress=False, kv_cache_tokens=100)
    assert llm.engine.kv.num_blocks == 7
    assert "KV cache: 112 tokens, " in capfd.readouterr().err
    llm = LLM(progress=False, max_num_seqs=1, max_model_len=64, kv_cache_tokens=10_000)  # never more than usable
    assert llm.engine.kv.num_blocks == 4
    llm = LLM(progress=False)  # 8 x 2048 tokens would take 112 MiB: within the CPU's 1 GiB
    assert llm.engine.kv.num_blocks == 8 * 128
    assert "(max_num_seqs 8 x max_model_len 2048)" in capfd.readouterr().err


def test_unseeded_sampling_differs_between_engines() -> None:
    """Without a seed, sampling is not the same run after run (the engine's seed of seeds was 0); with one it is."""
    params = SamplingParams(max_tokens=24, temperature=1.0)

    def text(**kw) -> str:
        return LLM(progress=False, **kw).generate("The king", params)[0].text

    assert len({text() for _ in range(3)}) > 1
    assert text(seed=5) == text(seed=5)


def _logits(llm: LLM, prompt: str, max_tokens: int) -> list[torch.Tensor]:
    rec, sampler = [], llm.engine.runner.sampler
    llm.engine.runner.sampler = lambda logits, *a: (rec.append(logits.clone()), sampler(logits, *a))[1]
    llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return rec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_request_logits_do_not_depend_on_kv_size_or_max_num_seqs(dtype: str) -> None:
    """README ("Greedy output"): a request that runs alone gets bitwise the same logits at any KV-cache size,
    max_num_seqs or max_model_len on the CPU (eager decode pads block tables to the batch's own width). What can
    change them (other requests in the batch, preemption, prefill chunks, CUDA's split-KV) is listed there."""
    prompt, n = "To be, or not to be, that is the question:", 40
    ref = _logits(LLM(progress=False, dtype=dtype), prompt, n)
    for kw in (
        dict(max_num_seqs=1, kv_cache_tokens=64),  # what `edgemoe generate` reserves
        dict(max_num_seqs=3, max_model_len=200),
        dict(kv_cache_memory=5 * PER_BLOCK // (2 if dtype == "bfloat16" else 1)),
    ):
        got = _logits(LLM(progress=False, dtype=dtype, **kw), prompt, n)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), kw
