"""Speculative decoding by prompt lookup (`--speculative ngram`, `edgemoe/engine/speculative.py`): the drafts against
a brute-force search, and greedy output token-identical with speculation on and off, on the demo model and tiny
checkpoints of every family that takes it (resident and offloaded), in batches that mix drafted, undrafted and
sampled sequences, stop strings, max_tokens and a KV cache too small for every draft. Drafts must be made and accepted
(the counters say so), or the comparison would prove nothing."""

from __future__ import annotations

import random

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.speculative import (
    Acceptance,
    NgramIndex,
    SpeculationGate,
    best_draft_count,
    expected_tokens,
    ngram_draft,
)
from edgemoe.errors import EdgeMoEError

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def reference_draft(tokens: list[int], max_n: int, k: int) -> list[int]:
    """Every (n, start) tried, longest n first, latest start first: the first match's continuation."""
    for n in range(max_n, 0, -1):
        if n >= len(tokens):
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            s = max(starts)
            return tokens[s + n : s + n + k]
    return []


def test_ngram_draft_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        max_n, k = rng.randrange(1, 5), rng.randrange(0, 6)
        assert (
            ngram_draft(tokens, max_n, k) == reference_draft(tokens, max_n, k)
            if k
            else ngram_draft(tokens, max_n, k) == []
        )
    assert ngram_draft([1, 2, 3, 1, 2], 3, 4) == [3, 1, 2]  # the tail "1 2" after its earlier occurrence
    assert ngram_draft([5, 5, 5], 2, 3) == [5]  # an occurrence overlapping the tail
    assert ngram_draft([1, 2, 3], 3, 4) == []


def generate(llm: LLM, batch: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Each prompt with its own parameters, batched in one engine: the generated ids."""
    params = params if isinstance(params, list) else [params] * len(batch)
    seqs = [llm.engine.add_request(ids, p) for ids, p in zip(batch, params)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return [s.output_ids for s in seqs]


def prompts(tok) -> list[list[int]]:
    """A passage repeated (what an agent copies), a counting pattern, and plain text."""
    return [
        tok.encode("ROMEO: But soft, what light through yonder window breaks? " * 4 + "ROMEO: But soft,"),
        tok.encode(" ".join(str(i) for i in range(1, 30))),
        tok.encode("Once upon a time"),
    ]


def speculative(*args, **opts) -> LLM:
    """An LLM with prompt lookup whose gate stays open."""
    llm = LLM(*args, speculative="ngram", **opts)
    llm.engine.gate = Open()
    return llm


@pytest.fixture(scope="module")
def demo_pair():
    return LLM(progress=False), speculative(progress=False, speculative_tokens=5)


def test_demo_model_greedy_identical_and_drafts_accepted(demo_pair) -> None:
    base, spec = demo_pair
    batch = prompts(base.engine.tokenizer)
    params = [GREEDY, SamplingParams(max_tokens=33, temperature=0, stop=["\n\n"]), GREEDY]
    want = generate(base, batch, params)
    before = spec.engine.speculative.accepted
    assert generate(spec, batch, params) == want
    stats = spec.engine.speculative.as_dict()
    assert stats["drafted"] > 0 and spec.engine.speculative.accepted > before, stats
    assert 1.0 < stats["tokens_per_step"] <= 6


def test_sampled_sequences_beside_drafted_ones_draw_as_before(demo_pair) -> None:
    """A seeded sampled request draws one token a step from its own generator, drafted neighbours or not."""
    base, spec = demo_pair
    batch = prompts(base.engine.tokenizer)
    params = [GREEDY, SamplingParams(max_tokens=30, temperature=0.8, seed=7), GREEDY]
    assert generate(spec, batch, params) == generate(base, batch, params)


def test_logits_processors_turn_drafting_off(demo_pair) -> None:
    """A logits processor reads one row a sequence a step: while one runs, nothing is drafted."""
    base, spec = demo_pair
    seen = []

    def ban_newline(seqs, logits):
        seen.append(logits.shape[0])
        logits[:, base.engine.tokenizer.encode("\n")[0]] = float("-inf")
        return logits

    batch = prompts(base.engine.tokenizer)[:2]
    before = spec.engine.speculative.steps
    outs = {}
    for name, llm in (("base", base), ("spec", spec)):
        llm.engine.logits_processors.append(ban_newline)
        try:
            outs[name] = generate(llm, batch, GREEDY)
        finally:
            llm.engine.logits_processors.remove(ban_newline)
    assert outs["spec"] == outs["base"] and spec.engine.speculative.steps == before and seen


def test_a_grammar_request_beside_drafted_ones(demo_pair) -> None:
    """The grammar's processor changes only its own sequences' logits (`applies_to`): the others still draft, and the
    constrained one samples through it in the verify steps as in plain ones."""
    base, spec = demo_pair
    batch = prompts(base.engine.tokenizer)[:2]
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0, grammar='start: "ROMEO" /[a-z ]+/ "."')]
    before = spec.engine.speculative.drafted
    want = generate(base, batch, params)
    assert generate(spec, batch, params) == want and spec.engine.speculative.drafted > before
    text = base.engine.tokenizer.decode(want[1])
    assert text.startswith("ROMEO") and set(text[5:].rstrip(".")) <= set("abcdefghijklmnopqrstuvwxyz ")


def test_a_small_kv_cache_trims_drafts() -> None:
    """Drafts take only free blocks (a draft never preempts): output as without speculation."""
    opts = dict(progress=False, kv_cache_tokens=160, max_num_seqs=3)
    base, spec = LLM(**opts), speculative(**opts, speculative_tokens=8)
    batch = prompts(base.engine.tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert generate(spec, batch, params) == generate(base, batch, params)
    assert spec.engine.speculative.drafted > 0


def oracle_drafter(engine, want: dict[tuple, list[int]], k: int = 4):
    """A drafter that knows each prompt's greedy continuation (`want`) and drafts its next k tokens, the i-th verify
    step's draft wrong from position i mod (k + 1) on (k: all right): every verify step keeps 0 to k drafts, so
    acceptance, the rows after a failed draft and (hybrids) the undone state are all exercised, whatever the model."""
    steps = iter(range(10**9))

    def draft(seq) -> list[int]:
        done = len(seq.output_ids)
        right = want[tuple(seq.token_ids[: seq.num_prompt_tokens])][done : done + k]
        wrong_from = next(steps) % (k + 1)
        return right[:wrong_from] + [(t + 1) % engine.model_config.vocab_size for t in right[wrong_from:]]

    return draft


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
@pytest.mark.parametrize(
    "case", ["qwen2-gqa-shared-dense", "qwen3-head-dim", "mixtral-gqa", "olmoe-mha-clip", "glm-groups-qknorm-mtp",
             "gpt-oss-yarn-window", "qwen3next-dense", "qwen35-tied-mha"],
)  # fmt: skip
def test_families_greedy_identical(tiny_checkpoint, case: str, offload: bool) -> None:
    """Drafts right up to a varying position (an oracle drafter): greedy tokens as without speculation, every family,
    the hybrids' recurrent state undone where a draft failed."""
    folder, _ = tiny_checkpoint(case, "per-expert")
    opts = dict(progress=False, dtype="float32", max_num_seqs=6)  # 4 rows for drafts beside the 2 sequences
    if offload:
        opts |= dict(moe_strategy="offload", moe_cache_fraction=0.5)
    base, spec = LLM(str(folder), **opts), speculative(str(folder), **opts)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (21, 9)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = generate(base, batch, params)
    spec.engine.scheduler.drafter = oracle_drafter(spec.engine, {tuple(b): w for b, w in zip(batch, want)})
    assert generate(spec, batch, params) == want
    stats = spec.engine.speculative
    assert stats.accepted > 0 and stats.drafted > stats.accepted, stats


def test_refusals() -> None:
    with pytest.raises(EdgeMoEError, match="unknown speculative 'eagle': use off or ngram or mtp"):
        LLM(progress=False, speculative="eagle")
    with pytest.raises(EdgeMoEError, match="speculative_tokens must be an integer >= 1"):
        LLM(progress=False, speculative="ngram", speculative_tokens=0)


def test_gate_follows_the_faster_kind_and_probes_the_other() -> None:
    gate = SpeculationGate(probe=3, weight=1.0, warmup=1)
    assert gate.open()  # nothing measured: draft
    gate.record(True, tokens=2, seqs=1, seconds=1.0)  # the first verify step: not measured (it may compile)
    assert gate.rates[True] is None
    gate.record(True, tokens=2, seqs=1, seconds=0.01)  # verify: 200 tok/s
    gate.record(False, tokens=1, seqs=1, seconds=1.0)  # the first plain step: not measured
    assert gate.open()  # plain not measured yet
    gate.record(False, tokens=1, seqs=1, seconds=0.002)  # plain: 500 tok/s, faster
    kinds = []
    for _ in range(8):  # plain preferred; every 4th step a verify probe
        verify = gate.open()
        kinds.append(verify)
        gate.record(verify, tokens=2 if verify else 1, seqs=1, seconds=0.01 if verify else 0.002)
    assert kinds == [False, False, False, True, False, False, False, True]
    gate.record(True, tokens=10, seqs=2, seconds=0.001)  # verify now 5,000 tok/s a sequence: drafting again
    assert gate.open() and gate.verify_preferred()
    gate.record(True, tokens=1, seqs=1, seconds=0.0)  # no time measured: ignored
    assert gate.rates[True] == 5000.0


class Open(SpeculationGate):
    """Drafts every step, every draft a sequence has room for (the tests that need drafts must not depend on this
    machine's timings)."""

    def open(self) -> bool:
        return True

    def drafts(self, seq: Acceptance, most: int, at: int) -> int:
        return max(most, 0)


def test_best_draft_count_against_brute_force() -> None:
    """The count with the most tokens a unit of time, against simulated verify steps (each draft accepted with
    probability a given the ones before were; a step of k drafts costs 1 + k * cost plain steps)."""
    rng = random.Random(3)
    for a, cost in [(0.0, 0.1), (0.9, 0.05), (0.7, 0.3), (0.4, 0.3), (0.2, 0.02), (0.95, 1.5), (1.0, 0.2)]:
        rates = []
        for k in range(5):
            trials = 20_000
            tokens = sum(1 + next((i for i in range(k) if rng.random() >= a), k) for _ in range(trials))
            rates.append(tokens / trials / (1 + k * cost))
        k = best_draft_count(a, cost, 4)
        assert rates[k] >= max(rates) * 0.98, (a, cost, k, rates)
        assert abs(expected_tokens(a, k) / (1 + k * cost) - rates[k]) < 0.03 * rates[k]
    assert best_draft_count(0.0, 0.01, 4) == 0  # drafts that always fail: plain decoding
    assert best_draft_count(1.0, 0.01, 4) == 4 and best_draft_count(1.0, 2.0, 4) == 0
    assert best_draft_count(0.6, 0.0, 4) == 4  # free rows: every draft


def test_acceptance_estimates_the_per_draft_probability() -> None:
    rng = random.Random(4)
    for a in (0.1, 0.5, 0.8):
        seq = Acceptance(decay=0.999)
        for _ in range(3000):
            d = rng.randint(1, 5)
            seq.record(d, next((i for i in range(d) if rng.random() >= a), d))
        assert abs(seq.rate - a) < 0.05, (a, seq.rate)
    seq = Acceptance(prior=0.5, weight=2.0, decay=0.5)
    seq.record(4, 4)  # all kept: 4 tried, 4 accepted
    assert seq.rate == (0.5 + 4) / (1 + 4)
    seq.record(3, 0)  # the first refused: 1 tried
    assert seq.rate == (0.5 * 4.5) / (0.5 * 5 + 1)
    seq.record(0, 0)  # nothing drafted: nothing learnt
    assert seq.rate == (0.5 * 4.5) / (0.5 * 5 + 1)


def test_a_sequence_whose_drafts_fail_turns_down_and_probes() -> None:
    gate = SpeculationGate(probe=4, weight=1.0, warmup=0)
    seq = Acceptance()
    assert gate.drafts(seq, 4, at=10) == 4  # no row cost measured yet: every draft
    gate.record(False, tokens=1, seqs=1, seconds=0.010, rows=1)
    gate.record(True, tokens=1, seqs=1, seconds=0.014, rows=5)  # 4 rows more: 1 ms each, 0.1 of a plain step
    assert gate.row_cost() == pytest.approx(0.1)
    assert gate.drafts(seq, 4, at=11) == best_draft_count(seq.rate, 0.1, 4) > 0
    assert gate.drafts(seq, 2, at=11) == min(best_draft_count(seq.rate, 0.1, 4), 2)  # asked again: the same answer
    for _ in range(6):
        seq.record(4, 0)
    assert seq.rate < 0.1
    answers = [gate.drafts(seq, 4, at=12 + i) for i in range(9)]
    assert answers == [0, 0, 0, 4, 0, 0, 0, 4, 0], answers  # plain decoding, and a probe every 4th step
    for _ in range(8):
        seq.record(4, 4)  # the probes' drafts all kept: the sequence drafts again
    assert gate.drafts(seq, 4, at=30) == 4
    gate.record(True, tokens=5, seqs=1, seconds=0.050, rows=5)  # rows now cost 1.0 of a plain step each
    assert gate.row_cost() == pytest.approx(1.0) and gate.drafts(seq, 4, at=31) == 0  # not even all-accepted pays


def test_a_closed_gate_drafts_nothing_and_changes_nothing(demo_pair) -> None:
    base, spec = demo_pair
    batch = prompts(base.engine.tokenizer)[:1]
    gate, spec.engine.gate = spec.engine.gate, SpeculationGate(probe=10**9)
    spec.engine.gate.rates = {True: 1.0, False: 1e9}  # verify steps measured far slower
    try:
        before = spec.engine.speculative.steps
        assert generate(spec, batch, GREEDY) == generate(base, batch, GREEDY)
        assert spec.engine.speculative.steps == before
    finally:
        spec.engine.gate = gate


def test_ngram_index_drafts_as_the_search_while_the_sequence_grows() -> None:
    rng = random.Random(1)
    for _ in range(300):
        max_n, tokens = rng.randrange(1, 5), []
        index = NgramIndex(max_n)
        for _ in range(rng.randrange(1, 60)):
            tokens += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]  # one token a step, or a verify's few
            k = rng.randrange(0, 6)
            assert index.draft(tokens, k) == ngram_draft(tokens, max_n, k)


def test_refused_drafts_count_what_only_refused_rows_missed() -> None:
    """`RefusedDrafts.count` against sets: per layer, the experts missed before the step that refused rows routed
    to and kept rows did not, in bytes."""
    from edgemoe.offload.expert_cache import RefusedDrafts

    g = torch.Generator().manual_seed(6)
    L, E, R, K = 3, 10, 6, 2
    drafts = RefusedDrafts(L, E, R, K, expert_bytes=7, device="cpu")
    want = [0] * L
    for _ in range(4):
        drafts.clear()
        rows = int(torch.randint(1, R + 1, (), generator=g))
        state = []
        for layer in range(L):
            ids = torch.randint(0, E, (rows, K), generator=g)
            slot_of = torch.where(torch.rand(E, generator=g) < 0.5, -1, 3)
            drafts.note(layer, ids, slot_of)
            state.append((ids.tolist(), {e for e in range(E) if slot_of[e] < 0}))
        kind = torch.randint(0, 3, (R,), generator=g).tolist()  # 0 kept, 1 refused, 2 neither (padding)
        kind = [k if r < rows else 2 for r, k in enumerate(kind)]
        drafts.count(torch.tensor([k == 0 for k in kind]), torch.tensor([k == 1 for k in kind]))
        for layer, (ids, absent) in enumerate(state):
            by = {k: {e for r, row in enumerate(ids) if kind[r] == k for e in row} for k in (0, 1)}
            want[layer] += 7 * len((by[1] - by[0]) & absent)
    assert drafts.bytes.tolist() == want and sum(want) > 0


def test_refused_drafts_in_the_expert_stats(tiny_checkpoint) -> None:
    """Offloaded experts with stats: drafts that are always right cost no refused bytes; drafts wrong from the first
    cost some (the rows after the first draft route to experts the kept row did not), never more than was missed;
    greedy tokens as without speculation."""
    folder, _ = tiny_checkpoint("qwen3-head-dim", "per-expert")
    opts = dict(progress=False, dtype="float32", max_num_seqs=6, moe_strategy="offload", moe_cache_fraction=0.5,
                moe_collect_stats=True)  # fmt: skip
    base = LLM(str(folder), **opts)
    g = torch.Generator().manual_seed(8)
    batch = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (17, 9)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = generate(base, batch, params)
    refused = {}
    for wrong_from in (4, 0):  # 4: every draft right (k = 4); 0: every draft wrong
        spec = speculative(str(folder), **opts)
        right = {tuple(b): w for b, w in zip(batch, want)}

        def draft(seq, wrong_from=wrong_from, right=right) -> list[int]:
            done = len(seq.output_ids)
            tokens = right[tuple(seq.token_ids[: seq.num_prompt_tokens])][done : done + 4]
            return tokens[:wrong_from] + [(t + 1) % 400 for t in tokens[wrong_from:]]

        spec.engine.scheduler.drafter = draft
        assert generate(spec, batch, params) == want
        total = spec.engine.moe_stats()["total"]
        refused[wrong_from] = total["refused_draft_bytes"]
        assert (
            0
            <= refused[wrong_from]
            <= total["bytes_copied"] + total["cpu_computed"] * spec.engine.expert_cache.expert_bytes
        )
    assert refused[4] == 0 and refused[0] > 0, refused
