"""The prefix cache: the KV blocks of a prompt's longest known whole-block prefix are reused, shared by reference
count, kept findable after release and evicted least recently released first. Checked against a plain-Python model
of the block pool, and end to end: greedy output identical with and without it (a multi-turn conversation, shared
prompts, a cache small enough to evict), with the reused tokens reported and the KV accounting exact."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.config import ModelConfig
from edgemoe.engine.kv_cache import KVCache

BS = 4
CFG = ModelConfig(
    model_type="qwen3_moe", vocab_size=64, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4,
    intermediate_size=8, num_experts=2, top_k=1, moe_intermediate_size=4, moe_layers=(True,), norm_topk_prob=True,
)  # fmt: skip


def pool(blocks: int = 6) -> KVCache:
    return KVCache(CFG, blocks, BS, torch.float32, torch.device("cpu"), prefix_cache=True)


def fill(kv: KVCache, tokens: list[int]) -> tuple[list[int], int, int | None]:
    """A sequence that computed all of `tokens`: its blocks, committed."""
    table = kv.match(tokens)
    table += kv.allocate(-(-len(tokens) // BS) - len(table))
    hashed, parent = kv.commit(tokens, table, len(tokens), 0, None)
    return table, hashed, parent


def test_match_reuses_whole_blocks_and_never_the_last_token() -> None:
    kv = pool()
    a = list(range(10))  # blocks [0-3] [4-7] and a partial [8, 9]
    table, hashed, _ = fill(kv, a)
    assert hashed == 2 and kv.num_free == 3
    assert kv.match(a) == table[:2] and kv.refs[table[0]] == 2  # shared, counted
    assert kv.match(a[:8]) == table[:1]  # 8 tokens: the last one must be computed, so one block
    assert kv.match([0, 1, 2, 3, 9, 9, 9, 9, 9]) == table[:1]  # diverges in the second block
    assert kv.match([1, 2, 3, 4, 5]) == []  # a block's hash covers everything before it, not just its tokens
    assert kv.hit_tokens == 8 + 4 + 4 and kv.queried_tokens == 10 + 10 + 8 + 9 + 5  # fill looked up too


def test_released_blocks_stay_findable_until_the_pool_needs_them() -> None:
    kv = pool(4)
    first, _, _ = fill(kv, list(range(8)))
    second, _, _ = fill(kv, list(range(100, 108)))
    kv.release(list(first))
    kv.release(list(second))
    assert kv.num_free == 4 and not kv.free  # all four known, none plainly free
    assert kv.match(list(range(100, 109))) == second  # found again, taken back from the released
    kv.allocate(2)  # evicts the least recently released: `first`'s blocks
    assert kv.match(list(range(9))) == []
    assert kv.num_free == 0


def test_a_prefix_known_in_another_block_chains_on() -> None:
    """Two sequences computing the same prompt side by side: the second's blocks stay unknown, and its later blocks
    still chain through the prefix's hash."""
    kv = pool(8)
    tokens = list(range(12))
    a = kv.allocate(3)
    b = kv.allocate(3)
    kv.commit(tokens, a, 8, 0, None)  # a knows blocks 0-1
    hashed, parent = kv.commit(tokens, b, 12, 0, None)  # b's 0-1 duplicate a's; its block 2 is new
    assert hashed == 3 and kv.key[b[0]] is None and kv.key[b[2]] is not None
    assert kv.match(tokens + [99]) == [a[0], a[1], b[2]]


def conversation(llm: LLM) -> list[list[int]]:
    """Three turns, each prompt the last one plus its answer plus a new question; then two prompts sharing one."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tok, prompt, out = llm.tokenizer, "ROMEO.\nWhat news from the court, my lord?", []
    ids = tok.encode(prompt)
    for question in ("\nJULIET.\nAnd then?", "\nROMEO.\nNo more."):
        answer = llm.generate([ids], greedy)[0]
        out.append(answer.token_ids)
        ids = ids + answer.token_ids + tok.encode(question, add_special_tokens=False)
    both = llm.generate([ids, ids[:40] + [7, 8, 9]], greedy)
    others = [tok.encode(f"{name}.\nGood morrow, good {name.lower()}; what brings thee hither?") for name in NAMES]
    again = llm.generate(others + [ids[:60]], greedy)  # fills the pool, then a prefix that was known
    return out + [o.token_ids for o in both + again]


NAMES = ("MERCUTIO", "BENVOLIO", "TYBALT", "CAPULET", "MONTAGUE", "PARIS")


@pytest.mark.parametrize("kv_tokens", [None, 144])  # 144: small enough to evict known blocks
def test_greedy_output_is_the_same_with_and_without(kv_tokens: int | None) -> None:
    opts = dict(progress=False, max_num_seqs=2, kv_cache_tokens=kv_tokens)
    with_cache, without = LLM(**opts), LLM(**opts, prefix_cache=False)
    assert conversation(with_cache) == conversation(without)
    kv = with_cache.engine.kv
    assert kv.hit_tokens > 0 and without.engine.kv.hit_tokens == 0
    assert (kv.evicted > 0) == (kv_tokens is not None)
    assert kv.num_free == kv.num_blocks and all(r == 0 for r in kv.refs)  # every block back, none leaked


def test_reused_tokens_are_reported() -> None:
    llm = LLM(progress=False)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    prompt = llm.tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")
    assert llm.generate([prompt], greedy)[0].cached_tokens == 0
    again = llm.generate([prompt + [5, 6]], greedy)[0]
    assert again.cached_tokens == (len(prompt) // 16) * 16 > 0
