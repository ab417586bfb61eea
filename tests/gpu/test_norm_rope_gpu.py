"""RMSNorm, rotary and attention-prologue kernels (`edgemoe.kernels.norm_rope`) compiled on CUDA against their torch
references (`RMSNorm.reference`, `RotaryEmbedding.forward`, `index_copy_` into the KV cache) at real
shapes in float32 and bf16, without host synchronisation, through the layers' CUDA dispatch (`Attention` against
its unfused sequence), and replayed from a CUDA graph with new inputs.

The prologue's rotary must be bitwise equal to torch's (it rounds where torch's separate ops round; no FMA). The norm
sums in another order than torch's reduction: float32 within 1e-6 relative, bf16 within a rare flipped rounding of
x * rsqrt. The prologue must be bitwise equal to the unfused sequence (the rms_norm kernel per head, torch's rotary,
index_copy_): same helpers, same warps."""

from __future__ import annotations

import pytest
import torch

from edgemoe.config import ModelConfig
from edgemoe.context import ForwardContext, set_context
from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.layers.attention import Attention
from edgemoe.layers.kernels import select_kernels
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.olmoe import OlmoeAttention, OlmoeSettings
from tests.gpu.sync_free import host_sync_forbidden
from tests.kernels.test_norm_rope import fused_prologue, unfused_prologue

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
MAX_POSITIONS = 40960  # Qwen3's table
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dtype)


def make_norm(dim: int, dtype: torch.dtype, g: torch.Generator, weight_dtype: torch.dtype | None = None) -> RMSNorm:
    norm = RMSNorm(dim, EPS).cuda()
    select_kernels(norm, torch.device("cuda"))
    norm.weight.data = (1 + 0.5 * torch.randn(dim, generator=g, device="cuda")).to(weight_dtype or dtype)
    return norm


def make_rotary() -> RotaryEmbedding:
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, 1e6)
    rotary.build("cuda")
    return rotary


def positions(tokens: int, g: torch.Generator) -> torch.Tensor:
    p = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g, device="cuda")
    p[-1] = p[0]  # a repeated position
    return p


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, x_dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-6 if x_dtype == torch.float32 else 2.5 * torch.finfo(x_dtype).eps
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.0)
    if x_dtype != torch.float32:
        assert (out == ref).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_rms_norm_matches_reference(hidden: int, tokens: int, dtype: torch.dtype) -> None:
    from edgemoe.kernels.norm_rope import rms_norm

    g = gen(tokens)
    norm = make_norm(hidden, dtype, g)
    x = randn(tokens, hidden, g=g, dtype=dtype, scale=3.0)
    out = rms_norm(x, norm.weight, EPS)
    assert_close_to_reference(out, norm.reference(x), dtype)
    assert torch.equal(norm(x), out)  # the layer dispatches to the kernel on CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 9])
def test_per_head_norm_on_projection_views(tokens: int, dtype: torch.dtype) -> None:
    # Qwen3's q/k norm on views of the projection outputs, [tokens, heads, head_dim]
    g = gen(100 + tokens)
    q_norm, k_norm = make_norm(HEAD_DIM, dtype, g), make_norm(HEAD_DIM, dtype, g)
    q = randn(tokens, HEADS * HEAD_DIM, g=g, dtype=dtype).view(-1, HEADS, HEAD_DIM)
    k = randn(tokens, KV_HEADS * HEAD_DIM, g=g, dtype=dtype).view(-1, KV_HEADS, HEAD_DIM)
    assert_close_to_reference(q_norm(q), q_norm.reference(q), dtype)
    assert_close_to_reference(k_norm(k), k_norm.reference(k), dtype)


def test_rms_norm_mixed_dtypes_promote_like_torch() -> None:
    g = gen(7)
    norm = make_norm(2048, torch.bfloat16, g, weight_dtype=torch.float32)
    x = randn(5, 2048, g=g, dtype=torch.bfloat16)
    out, ref = norm(x), norm.reference(x)
    assert out.dtype == ref.dtype == torch.float32
    assert_close_to_reference(out, ref, torch.bfloat16)


def test_no_host_sync_once_compiled() -> None:
    from edgemoe.kernels.norm_rope import rms_norm

    g = gen(0)
    x, w = randn(1, 2048, g=g, dtype=torch.bfloat16), randn(2048, g=g, dtype=torch.bfloat16)
    rms_norm(x, w, EPS)  # compiles (may sync)
    with torch.cuda.device(x.device), host_sync_forbidden():
        rms_norm(x, w, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype) -> None:
    """The attention prologue of a Qwen3 layer (input norm, per-head q/k norm, rotary) captured once over static
    buffers and replayed with new hidden states, projections and positions written into them."""
    tokens, hidden = 2, 4096
    g = gen(1)
    input_norm, q_norm, k_norm = (
        make_norm(hidden, dtype, g),
        make_norm(HEAD_DIM, dtype, g),
        make_norm(HEAD_DIM, dtype, g),
    )
    rotary = make_rotary()
    x = randn(tokens, hidden, g=g, dtype=dtype)
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, dtype=dtype)
    pos = positions(tokens, g)

    def prologue() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        q_out, k_out = rotary(pos, q_norm(q), k_norm(k))
        return input_norm(x), q_out, k_out

    graph, outs = capture_graph(prologue)
    for seed in range(2, 5):
        g = gen(seed)
        x.copy_(randn(tokens, hidden, g=g, dtype=dtype))
        qkv.copy_(randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, dtype=dtype))
        pos.copy_(positions(tokens, g))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        eager = prologue()
        for o, e in zip(outs, eager):
            assert torch.equal(o, e)  # every element rewritten, deterministic
        assert_close_to_reference(outs[0], input_norm.reference(x), dtype)
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        q_ref, k_ref = rotary(pos, q_norm(q), k_norm(k))  # on the kernel's norms: rotary alone
        assert torch.equal(outs[1], q_ref) and torch.equal(outs[2], k_ref)


PROLOGUE_SHAPES = [(HEADS, KV_HEADS, HEAD_DIM), (16, 16, HEAD_DIM)]  # (heads, kv_heads, head_dim): GQA 8 (Qwen3), MHA
SLOTS = 4096


def prologue_case(
    tokens: int, heads: int, kv_heads: int, dtype: torch.dtype, g: torch.Generator, norm: bool = True
) -> tuple[torch.Tensor | None, ...]:
    """attention_prologue's arguments: q, k, v (separate projections, as Attention's), positions, the table,
    caches of random values (a stray write shows) and distinct random slots in them, [norm weights]."""
    q = randn(tokens, heads, HEAD_DIM, g=g, dtype=dtype, scale=2.0)
    k = randn(tokens, kv_heads, HEAD_DIM, g=g, dtype=dtype, scale=2.0)
    v = randn(tokens, kv_heads, HEAD_DIM, g=g, dtype=dtype)
    k_cache, v_cache = (randn(SLOTS, kv_heads, HEAD_DIM, g=g, dtype=dtype) for _ in range(2))
    slots = torch.randperm(SLOTS, generator=g, device="cuda")[:tokens]
    weights = (make_norm(HEAD_DIM, dtype, g).weight, make_norm(HEAD_DIM, dtype, g).weight) if norm else (None, None)
    return q, k, v, positions(tokens, g), make_rotary().cos_sin, k_cache, v_cache, slots, *weights


def assert_bitwise(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...], what: str = "") -> None:
    for name, out, ref in zip(("q_out", "k_cache", "v_cache"), outs, refs, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        bad = (out != ref).sum().item()
        assert bad == 0, f"{what} {name}: {bad} of {out.numel()} elements differ, max {(out - ref).abs().max()}"


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 9, 300])
@pytest.mark.parametrize("shape", PROLOGUE_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_prologue_bitwise_equal_to_unfused_kernels(
    shape: tuple[int, int, int], tokens: int, dtype: torch.dtype, norm: bool
) -> None:
    """Bitwise: the norm's sum runs through the same helper with rms_norm's block and warps (its order follows the
    layout). Untouched cache slots keep their values; the inputs stay as they were."""
    heads, kv_heads, _ = shape
    case = prologue_case(tokens, heads, kv_heads, dtype, gen(300 + tokens), norm)
    q, k, v, k_cache, v_cache, slots = case[0], case[1], case[2], case[5], case[6], case[7]
    inputs = [t.clone() for t in (q, k, v, k_cache, v_cache)]
    outs = fused_prologue(*case)
    assert_bitwise(outs, unfused_prologue(*case), "vs unfused kernels:")
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v, k_cache, v_cache)))
    untouched = torch.ones(SLOTS, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(outs[1][untouched], k_cache[untouched]) and torch.equal(outs[2][untouched], v_cache[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("shape", PROLOGUE_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_prologue_matches_torch_references(shape: tuple[int, int, int], tokens: int, dtype: torch.dtype) -> None:
    """Without the norm: bitwise to torch's rotary + index_copy_. With it: bitwise to torch's rotary + index_copy_ on
    the rms_norm kernel's per-head values, which are within the norm tolerance of torch's norm."""
    from edgemoe.kernels.norm_rope import rms_norm

    heads, kv_heads, _ = shape
    case = prologue_case(tokens, heads, kv_heads, dtype, gen(400 + tokens), norm=False)
    assert_bitwise(fused_prologue(*case), unfused_prologue(*case), "no norm, vs torch:")
    q, k, v, pos, cos_sin, k_cache, v_cache, slots, q_w, k_w = prologue_case(
        tokens, heads, kv_heads, dtype, gen(500 + tokens)
    )
    q_n, k_n = rms_norm(q, q_w, EPS), rms_norm(k, k_w, EPS)
    refs = unfused_prologue(q_n, k_n, v, pos, cos_sin, k_cache, v_cache, slots, None, None)
    assert_bitwise(fused_prologue(q, k, v, pos, cos_sin, k_cache, v_cache, slots, q_w, k_w), refs, "norm, vs torch:")
    for x, w, x_n in ((q, q_w, q_n), (k, k_w, k_n)):
        norm = RMSNorm(HEAD_DIM, EPS)
        norm.weight.data = w
        assert_close_to_reference(x_n, norm.reference(x), dtype)


def test_prologue_offsets_past_int32() -> None:
    """Caches of more than 2^31 elements (a long-context pool), the slots written at their end: slot * stride needs
    int64. Only the tail is compared (a clone of the whole cache would need another 8.6 GB)."""
    from edgemoe.kernels.norm_rope import attention_prologue

    g = gen(11)
    tail = 1024
    num_slots = 2**31 // (KV_HEADS * HEAD_DIM) + tail
    k_cache = torch.empty(num_slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")  # 4.3 GB each
    v_cache = torch.empty_like(k_cache)
    q, k, v, pos, cos_sin, k_tail, v_tail, slots, q_w, k_w = prologue_case(5, HEADS, KV_HEADS, torch.bfloat16, g)
    k_tail, v_tail = k_tail[:tail], v_tail[:tail]
    slots = torch.randperm(tail, generator=g, device="cuda")[:5]
    k_cache[-tail:], v_cache[-tail:] = k_tail, v_tail
    q_out = attention_prologue(q, k, v, pos, cos_sin, k_cache, v_cache, slots + num_slots - tail, q_w, k_w, EPS)
    refs = unfused_prologue(q, k, v, pos, cos_sin, k_tail, v_tail, slots, q_w, k_w)
    assert_bitwise((q_out, k_cache[-tail:], v_cache[-tail:]), refs, "past int32:")


def test_prologue_no_host_sync_once_compiled() -> None:
    from edgemoe.kernels.norm_rope import attention_prologue

    case = prologue_case(1, HEADS, KV_HEADS, torch.bfloat16, gen(12))
    attention_prologue(*case, EPS)  # compiles (may sync)
    with torch.cuda.device(case[0].device), host_sync_forbidden():
        attention_prologue(*case, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prologue_cuda_graph_replays_new_inputs_and_slots(dtype: torch.dtype) -> None:
    """Captured once over static buffers (q, k, v as views of one qkv projection, positions, slot mapping, caches);
    each replay gets new projections, positions, slots and cache contents written into them, and must equal the
    unfused kernels run eagerly on the same inputs."""
    from edgemoe.kernels.norm_rope import attention_prologue

    tokens = 4
    g = gen(13)
    _, _, _, pos, cos_sin, k_cache, v_cache, slots, q_w, k_w = prologue_case(tokens, HEADS, KV_HEADS, dtype, g)
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, g=g, dtype=dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)

    def step() -> torch.Tensor:
        return attention_prologue(q, k, v, pos, cos_sin, k_cache, v_cache, slots, q_w, k_w, EPS)

    graph, q_out = capture_graph(step)
    for seed in range(14, 18):
        g = gen(seed)
        qkv.copy_(randn(*qkv.shape, g=g, dtype=dtype, scale=2.0))
        pos.copy_(positions(tokens, g))
        slots.copy_(torch.randperm(SLOTS, generator=g, device="cuda")[:tokens])
        k_cache.copy_(randn(*k_cache.shape, g=g, dtype=dtype))
        v_cache.copy_(randn(*v_cache.shape, g=g, dtype=dtype))
        q_out.fill_(float("nan"))
        before = k_cache.clone(), v_cache.clone()
        graph.replay()
        refs = unfused_prologue(q, k, v, pos, cos_sin, *before, slots, q_w, k_w)
        assert_bitwise((q_out, k_cache, v_cache), refs, f"replay {seed}:")


BLOCK_SIZE = 16


def make_attention(qk_norm: str | None, clip: float | None, dtype: torch.dtype, g: torch.Generator) -> Attention:
    """A Qwen3-like ("head") or OLMoE-like ("full", clip) attention layer on CUDA with random weights, its kernels
    chosen as the loader chooses them, and a KV cache of random values."""
    if qk_norm == "full":
        cfg = ModelConfig(
            model_type="olmoe", vocab_size=16, hidden_size=1024, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM, intermediate_size=16, num_experts=1, top_k=1, moe_intermediate_size=16,
            moe_layers=(False,), norm_topk_prob=False, family_config=OlmoeSettings(clip_qkv=clip), rms_norm_eps=EPS,
            max_position_embeddings=MAX_POSITIONS, rope_theta=1e6,
        )  # fmt: skip
        layer = OlmoeAttention(cfg, make_rotary())
    else:
        eps = EPS if qk_norm == "head" else None
        layer = Attention(1024, HEADS, KV_HEADS, HEAD_DIM, make_rotary(), head_norm_eps=eps)
    layer = layer.to("cuda", dtype)
    select_kernels(layer, torch.device("cuda"))
    if qk_norm is not None:
        layer.q_norm.weight.data = make_norm(layer.q_norm.weight.shape[0], dtype, g).weight.data
        layer.k_norm.weight.data = make_norm(layer.k_norm.weight.shape[0], dtype, g).weight.data
    layer.attn.bind(*(randn(SLOTS, KV_HEADS, HEAD_DIM, g=g, dtype=dtype) for _ in range(2)), BLOCK_SIZE)
    return layer


def unfused_forward(layer: Attention, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Attention.forward before the fusion (each op its own kernel): the reference of the wiring."""
    q, k, v = layer.transform_qkv(*layer.qkv_proj(x).split(layer.qkv_sizes, dim=-1))
    q, k, v = q.view(-1, layer.nq, layer.d), k.view(-1, layer.nkv, layer.d), v.view(-1, layer.nkv, layer.d)
    if layer.head_norm:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = layer.rotary[0](pos, q, k)
    return layer.o_proj(layer.attn(q, k, v))


def batch_context(lens: list[int], new: list[int], prefill: bool) -> tuple[ForwardContext, torch.Tensor]:
    """Sequences of `lens` tokens whose last `new` are this step's, in shuffled blocks -> context, positions."""
    perm = torch.randperm(SLOTS // BLOCK_SIZE, generator=torch.Generator().manual_seed(sum(lens))).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    tables = torch.tensor([perm[i * width : (i + 1) * width] for i in range(len(lens))])
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(new))
    slots = tables[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    ctx = ForwardContext(
        prefill, slots.cuda(), torch.tensor(lens).cuda(), tables.cuda(),
        query_lens=new if prefill else None, context_lens_host=lens if prefill else None,
    )  # fmt: skip
    return ctx, pos.cuda()


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qk_norm, clip", [("head", None), ("full", 0.3), (None, None)], ids=str)
def test_self_attention_fused_prologue_equals_unfused(
    qk_norm: str | None, clip: float | None, dtype: torch.dtype, prefill: bool
) -> None:
    """Attention on CUDA (fused prologue, then attention over the cache it wrote) against its unfused sequence
    on a copy of the same cache: output and caches bitwise; decode without host syncs."""
    g = gen(20)
    layer = make_attention(qk_norm, clip, dtype, g)
    lens = [40, 7, 300] if prefill else [40, 1, 700]
    ctx, pos = batch_context(lens, lens if prefill else [1, 1, 1], prefill)
    x = randn(pos.shape[0], 1024, g=g, dtype=dtype)
    caches = layer.attn.k_cache.clone(), layer.attn.v_cache.clone()
    set_context(ctx)
    try:
        with torch.inference_mode():
            out = layer(x, pos)
            fused = layer.attn.k_cache, layer.attn.v_cache
            layer.attn.k_cache, layer.attn.v_cache = caches
            ref = unfused_forward(layer, x, pos)
            assert torch.equal(out, ref)
            assert torch.equal(fused[0], caches[0]) and torch.equal(fused[1], caches[1])
            if not prefill:  # compiled and warm now
                with host_sync_forbidden():
                    layer(x, pos)
    finally:
        set_context(None)
