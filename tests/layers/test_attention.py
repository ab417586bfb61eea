"""Prefill attention over the paged KV cache: a later chunk or a prompt after a cached prefix attends through
`causal_lower_right` with grouped K/V as they are; the same outputs as a [new, keys] mask over K/V repeated per query
head (the path it replaced, kept here as the reference), and the same greedy tokens end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe import LLM, SamplingParams
from edgemoe.context import ForwardContext, set_context
from edgemoe.layers.attention import PagedAttention

BLOCK = 4


def masked_prefill(attn: PagedAttention, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """The reference: every sequence's queries against its keys under an explicit causal mask, K/V repeated."""
    outs, start, groups = [], 0, attn.num_heads // attn.num_kv_heads
    for i, (n_new, n_ctx) in enumerate(zip(ctx.query_lens, ctx.context_lens_host)):
        k, v = attn._gather(ctx.block_tables[i : i + 1, : -(-n_ctx // attn.block_size)])
        k, v = k[:, :, :n_ctx].repeat_interleave(groups, dim=1), v[:, :, :n_ctx].repeat_interleave(groups, dim=1)
        mask = torch.arange(n_ctx)[None, :] <= torch.arange(n_ctx - n_new, n_ctx)[:, None]  # [new, keys]
        qi = q[start : start + n_new].transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=attn.scale)[0].transpose(0, 1))
        start += n_new
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_chunks_match_the_masked_reference(heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """Whole prompts, later chunks (one token, less than a block, several blocks) and their mix in one step."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, lens = 16, [(7, 7), (1, 9), (5, 13), (12, 30), (30, 30)]  # (new tokens, context) per sequence
    attn = PagedAttention(heads, kv_heads, dim)
    width = max(-(-n // BLOCK) for _, n in lens)
    slots = (len(lens) * width + 1) * BLOCK
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    attn.bind(k_cache, torch.randn(slots, kv_heads, dim, generator=g).to(dtype), BLOCK)
    tables = torch.randperm(len(lens) * width, generator=g).view(len(lens), width)  # scattered blocks
    q = torch.randn(sum(n for n, _ in lens), heads, dim, generator=g).to(dtype)
    ctx = ForwardContext(
        is_prefill=True,
        slot_mapping=torch.zeros(0, dtype=torch.long),
        context_lens=torch.tensor([n for _, n in lens]),
        block_tables=tables,
        query_lens=[n for n, _ in lens],
        context_lens_host=[n for _, n in lens],
    )
    set_context(ctx)
    try:
        out = attn._prefill(q, ctx)
    finally:
        set_context(None)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, masked_prefill(attn, q, ctx), **tol)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_greedy_tokens_match_the_masked_path(monkeypatch) -> None:
    """Prompts prefilled in 16-token chunks, and a second turn after a cached prefix: the same tokens as the masked
    reference gives, and as whole prompts."""
    g = torch.Generator().manual_seed(0)
    first = torch.randint(3, 6000, (70,), generator=g).tolist()
    prompts = [first, first + torch.randint(3, 6000, (23,), generator=g).tolist()]

    def run(**kw) -> list[list[int]]:
        llm = LLM(progress=False, max_num_seqs=2, max_model_len=256, **kw)
        outs = [llm.generate([p], GREEDY)[0] for p in prompts]
        assert outs[1].cached_tokens == 64  # the second prompt starts after the first's 4 whole blocks
        return [out.token_ids for out in outs]

    chunked, whole = run(max_num_batched_tokens=16), run()
    monkeypatch.setattr(PagedAttention, "_prefill", masked_prefill)
    assert chunked == run(max_num_batched_tokens=16) and whole == run()
    assert chunked == whole


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_sink_attention_matches_transformers_eager(heads: int, kv_heads: int, window: int | None) -> None:
    """`sink_attention` against transformers' gpt-oss eager attention (its sinks and its causal or sliding-window mask
    as an additive bias), on fresh random q, k, v and sinks large enough to take a visible share of the softmax."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from edgemoe.layers.attention import sink_attention

    g = torch.Generator().manual_seed(heads + kv_heads + (window or 0))
    new, keys, d = 6, 11, 16
    q = torch.randn(1, heads, new, d, generator=g)
    k, v = torch.randn(1, kv_heads, keys, d, generator=g), torch.randn(1, kv_heads, keys, d, generator=g)
    sinks = 2 * torch.randn(heads, generator=g)
    q_pos, k_pos = torch.arange(keys - new, keys)[:, None], torch.arange(keys)[None, :]
    seen = (k_pos <= q_pos) & (True if window is None else k_pos > q_pos - window)  # [new, keys]
    bias = torch.zeros(new, keys).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    ref, _ = eager_attention_forward(module, q, k, v, bias, scaling=d**-0.5)  # [1, new, heads, d]
    ours = sink_attention(q, k, v, seen, d**-0.5, sinks)
    torch.testing.assert_close(ours, ref.transpose(1, 2), atol=1e-6, rtol=1e-5)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=heads != kv_heads)
    assert not torch.allclose(ours, plain, atol=1e-3)  # the sinks took a share
