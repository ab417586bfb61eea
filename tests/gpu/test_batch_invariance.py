"""Same numbers whatever the path (README, "What is guaranteed"): every decode step's logits are bitwise equal with
CUDA graphs on and off, with experts resident and offloaded, and whatever else a sequence is batched with.

Each run records, for every step, the logits of every sequence keyed by the tokens that sequence held, so two runs
compare step by step; a greedy token that flips shows up as keys one run has and the other lacks.
"""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.tools.make_model import make_model
from tests.step_logits import record_step_logits

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe_text", "glm4_moe", "gpt_oss")
NEW = FAMILIES[4:]  # hybrids (recurrent state + KV), grouped sigmoid routing, sinks + windows + expert biases
SEEDS = {family: range(2) if family in NEW else range(5) for family in FAMILIES}  # 28 checkpoints
PROMPTS = [
    "ROMEO.\n",
    "Of Man's first disobedience, and the fruit",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows",
    "KING.",
    "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father",
    "Now is the winter of our discontent made glorious summer",
    "A",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
]


def step_logits(llm: LLM, prompts: list[str], max_tokens: int) -> dict[tuple[int, ...], torch.Tensor]:
    """Greedy generation -> {tokens a sequence held at a step: the logits it got there (float32, CPU)}."""
    seen = record_step_logits(llm)
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return seen


def assert_same_steps(a: dict, b: dict, what: str, subset: bool = False) -> None:
    """b's steps are a's (or, with `subset`, some of them) with bitwise equal logits."""
    apart = len(b.keys() - a.keys()) if subset else len(a.keys() ^ b.keys())
    assert not apart, f"{what}: greedy tokens differ ({apart} steps apart)"
    for key in sorted(b.keys(), key=len):
        if not torch.equal(a[key], b[key]):
            diff = (a[key] - b[key]).abs().max().item()
            pytest.fail(f"{what}: logits differ at {len(key)} tokens (max |diff| {diff:.3g})")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, int], str]:
    root = tmp_path_factory.mktemp("invariance")
    return {
        (family, seed): str(make_model(root / f"{family}-{seed}", family, "tiny", seed=seed, dtype="bfloat16"))
        for family in FAMILIES
        for seed in SEEDS[family]
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_graphs_equal_eager_resident_and_offloaded(checkpoints, family) -> None:
    for seed in SEEDS[family]:
        runs = {}
        for graphs in (False, True):
            for offload in (False, True):
                # copy-only: `--moe-cpu-compute auto` may keep a CPU split, whose fp32 expert sums round otherwise
                # (tokens equal, logits within 5e-4: tests/gpu/test_cpu_split_gpu.py)
                opts = dict(moe_strategy="offload", moe_cache_slots=10, moe_cpu_compute="off") if offload else {}
                llm = LLM(checkpoints[family, seed], device="cuda", progress=False, cuda_graphs=graphs, max_num_seqs=4,
                          **opts)  # fmt: skip
                runs[graphs, offload] = step_logits(llm, PROMPTS[:4], 24)
                del llm
        for key, run in runs.items():
            assert_same_steps(runs[False, False], run, f"{family} seed {seed}, (graphs, offload) {key} vs eager")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", *NEW])
@pytest.mark.parametrize("graphs", [True, False])
def test_decode_does_not_depend_on_the_batch(checkpoints, family, graphs) -> None:
    """Each prompt alone against batches of every size up to 8. Prefill runs one sequence a step
    (`batch_invariant`), so that the KV each sequence decodes from is its own whatever the batch."""
    path = checkpoints[family, 0]
    llm = LLM(path, device="cuda", progress=False, cuda_graphs=graphs, max_num_seqs=8, batch_invariant=True)
    alone = {}
    for prompt in PROMPTS:
        alone |= step_logits(llm, [prompt], 16)
    for n in range(2, len(PROMPTS) + 1):
        assert_same_steps(alone, step_logits(llm, PROMPTS[:n], 16), f"{family}: batch of {n}", subset=True)
