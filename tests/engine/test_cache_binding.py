"""Caches bind what they serve: the KV cache finds the model's paged-attention modules by type and gives each its
views and the block size (no family constructor takes a block size), counts and allocates only layers that hold KV,
and a layer that keeps other per-sequence state binds to a cache of its own the same way (here a test-only layer that
counts the tokens it saw, the smallest honest stand-in for a linear-attention layer's recurrent state)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.context import ForwardContext, set_context
from edgemoe.engine.kv_cache import KVCache, bytes_per_block
from edgemoe.layers.attention import PagedAttention
from edgemoe.models.decoder import DecoderLayer, MoEForCausalLM
from edgemoe.models.qwen3_moe import Qwen3MoeDecoderLayer

BS = 4


def config(no_kv: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=32, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
        intermediate_size=8, num_experts=2, top_k=1, moe_intermediate_size=8, moe_layers=(False,) * 3,
        norm_topk_prob=False, no_kv_layers=no_kv,
    )  # fmt: skip


class TokenCounter(nn.Module):
    """Keeps a per-sequence count (its state) instead of K/V: bound to a slot of its cache's pool."""

    def __init__(self) -> None:
        super().__init__()
        self.state = torch.empty(0)  # bound by `CountCache`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state += x.shape[0]
        return x


class CountingLayer(DecoderLayer):
    """A decoder layer with no attention: its mixer is a `TokenCounter`."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.counter = TokenCounter()

    def forward(self, x, positions, residual):  # noqa: ANN001, ANN201 - DecoderLayer's
        return self.counter(x), (x if residual is None else residual)


class CountCache:
    """The test's state cache: one counter a layer that keeps one, bound as the KV cache binds attention."""

    def __init__(self, layers: int) -> None:
        self.pool = torch.zeros(layers, dtype=torch.long)

    def bind(self, model: nn.Module) -> None:
        found = [m for m in model.modules() if isinstance(m, TokenCounter)]
        for i, counter in enumerate(found):
            counter.state = self.pool[i : i + 1]


def layers(cfg: ModelConfig, i: int, rotary: nn.Module) -> DecoderLayer:
    """Layer 1 counts tokens; the others are Qwen3-MoE's."""
    return CountingLayer(cfg, i) if i in cfg.no_kv_layers else Qwen3MoeDecoderLayer(cfg, i, rotary)


def test_kv_cache_binds_only_the_layers_that_attend() -> None:
    cfg = config(no_kv=(1,))
    assert cfg.kv_layers()[1] is None and bytes_per_block(cfg, BS, torch.float32) == 2 * BS * 2 * 8 * 4
    assert bytes_per_block(config(), BS, torch.float32) == 3 * 2 * BS * 8 * 4
    model = MoEForCausalLM(cfg, layers)
    kv = KVCache(cfg, 5, BS, torch.float32, torch.device("cpu"))
    assert kv.k.numel() == 2 * (5 + 1) * BS * 8  # two layers' slots, the pad block included
    kv.bind(model)
    attns = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert len(attns) == 2 and all(a.block_size == BS for a in attns)
    assert attns[0].k_cache.data_ptr() != attns[1].k_cache.data_ptr()
    counts = CountCache(1)
    counts.bind(model)
    x = torch.randn(6, 16)
    set_context(ForwardContext(True, torch.arange(6), torch.tensor([6]), torch.arange(2)[None], [6], [6]))
    try:
        model.model.layers[1](x, torch.arange(6), None)
        model.model.layers[1](x[:2], torch.arange(2), None)
    finally:
        set_context(None)
    assert counts.pool.tolist() == [8]  # the layer wrote its bound state


def test_kv_cache_refuses_a_model_it_does_not_fit() -> None:
    model = MoEForCausalLM(config(), layers)  # three attending layers
    kv = KVCache(config(no_kv=(1,)), 5, BS, torch.float32, torch.device("cpu"))  # a cache for two
    with pytest.raises(ValueError, match="3 paged-attention layers; the KV cache has 2"):
        kv.bind(model)
