"""Dense weights kept as a GGUF file stores them (`QuantLinear`) and the token embedding in host memory
(`HostEmbedding`): the kernel path (Triton's interpreter off CUDA) against the plain-torch reference on fresh random
blocks, a projection whose parts differ in format, batch invariance in decode, and the loader keeping a Q4_K_M file's
projections as stored with logits bitwise those of the dequantized load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from edgemoe.context import ForwardContext, set_context  # noqa: E402
from edgemoe.layers.quant_linear import HostEmbedding, QuantLinear  # noqa: E402
from edgemoe.quant import dequantize, random_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv_like(seed: int, bias: bool = True) -> QuantLinear:
    """A 256-wide projection of 96 + 32 rows in Q4_K, then 64 in Q6_K (q and k, then v of a Q4_K_M file)."""
    g = torch.Generator().manual_seed(seed)
    layer = QuantLinear(256, 192, [(128, "Q4_K"), (64, "Q6_K")], bias, torch.float32)
    layer.raw0.copy_(random_blocks((128, 256), "Q4_K", g, std=1 / 16))
    layer.raw1.copy_(random_blocks((64, 256), "Q6_K", g, std=1 / 16))
    if bias:
        layer.bias.data.copy_(torch.randn(192, generator=g))
    return layer.to(DEVICE)


def run(layer: QuantLinear, x: torch.Tensor, prefill: bool) -> torch.Tensor:
    set_context(ForwardContext(prefill, None, None, None))
    try:
        return layer(x)
    finally:
        set_context(None)


@pytest.mark.parametrize("prefill", [False, True])
def test_kernel_matches_reference(prefill: bool) -> None:
    layer = qkv_like(1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20 if prefill else 3, 256, generator=g).to(DEVICE)
    expected = F.linear(x, torch.cat([dequantize(layer.raw0, "Q4_K", 256), dequantize(layer.raw1, "Q6_K", 256)]),
                        layer.bias)  # fmt: skip
    assert torch.equal(run(layer, x, prefill), expected)  # the reference: no kernel chosen
    layer.use_kernels(torch.device(DEVICE))
    got = run(layer, x, prefill)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def test_decode_rows_do_not_depend_on_the_batch() -> None:
    """A token's row is bitwise the same alone and in a batch of 5 or 17 (one decode tile shape for every batch)."""
    layer = qkv_like(3, bias=False)
    layer.use_kernels(torch.device(DEVICE))
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    alone = run(layer, x[:1], prefill=False)
    assert torch.equal(run(layer, x[:5], prefill=False)[:1], alone)
    assert torch.equal(run(layer, x, prefill=False)[:1], alone)


def test_host_embedding_gathers_its_rows() -> None:
    g = torch.Generator().manual_seed(5)
    table = torch.randn(50, 24, generator=g)
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    module = HostEmbedding(table)
    assert torch.equal(module(ids), F.embedding(ids, table))
    module.use_kernels(torch.device(DEVICE))  # the device gather (the interpreter off CUDA)
    assert torch.equal(module(ids.to(DEVICE)).cpu(), F.embedding(ids, table))


def test_gguf_projections_kept_as_stored_give_the_same_logits(tmp_path) -> None:
    """A Q4_K_M file (make-model: attention Q4_K, v and the output Q6_K): loaded with its dense weights as stored
    (`QuantLinear`, the reference forward on the CPU) the logits are bitwise those of the dequantized load."""
    pytest.importorskip("gguf")
    from edgemoe.models.loader import LoadOptions, load_gguf
    from edgemoe.models.registry import read_checkpoint
    from edgemoe.tools.make_model import make_model

    path = make_model(tmp_path, "qwen3_moe", "tiny-k", dtype="float32", format="gguf", expert_dtype="q4_k_m")
    cfg, family, ckpt = read_checkpoint(path)
    cpu = torch.device("cpu")
    dense = load_gguf(ckpt, cfg, family, LoadOptions(cpu, torch.float32, progress=False))
    stored = load_gguf(ckpt, cfg, family, LoadOptions(cpu, torch.float32, progress=False, dense_as_stored=True))
    kept = {
        n: [(q.name, rows) for _, rows, q in m.parts] for n, m in stored.named_modules() if isinstance(m, QuantLinear)
    }
    assert kept["model.layers.0.self_attn.qkv_proj"] == [("Q4_K", 384), ("Q6_K", 128)]
    assert kept["lm_head"] == [("Q6_K", cfg.vocab_size)] and len(kept) == 2 * cfg.num_layers + 1
    ids, positions = torch.tensor([5, 17, 300, 4000]), torch.arange(4)
    ctx = ForwardContext(True, torch.arange(4), torch.tensor([4]), torch.zeros(1, 1, dtype=torch.long), [4], [4])
    from edgemoe.engine.kv_cache import KVCache

    outs = []
    for model in (dense, stored):
        KVCache(cfg, 2, 16, torch.float32, cpu).bind(model)
        set_context(ctx)
        try:
            outs.append(model.logits(model(ids, positions)))
        finally:
            set_context(None)
    assert torch.equal(outs[0], outs[1])
