"""Qwen2-MoE (Qwen1.5-MoE): qkv bias, a sigmoid-gated shared expert, optional dense layers."""

from __future__ import annotations

from edgemoe.config import ModelConfig
from edgemoe.layers.attention import Attention
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, moe_or_mlp
from edgemoe.models.hf_config import common_fields, sparse_layers

MODEL_TYPE = "qwen2_moe"


def normalise(hf: dict) -> ModelConfig:
    experts = hf["num_experts"]
    return ModelConfig(
        **common_fields(hf),
        intermediate_size=hf.get("intermediate_size", 0),
        num_experts=experts,
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        moe_layers=sparse_layers(hf, experts),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
        qkv_bias=bool(hf.get("qkv_bias", True)),
    )


def rename(name: str) -> str:
    return name


class Qwen2MoeDecoderLayer(DecoderLayer):
    """Attention with qkv bias; routed experts plus a sigmoid-gated shared expert, or a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, qkv_bias=cfg.qkv_bias
        )
        self.mlp = moe_or_mlp(cfg, self, shared=cfg.shared_expert_intermediate_size)


LAYER = Qwen2MoeDecoderLayer
