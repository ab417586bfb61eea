"""OLMoE: q/k RMSNorm over all heads (before RoPE), optional qkv clipping, every layer sparse."""

from __future__ import annotations

from edgemoe.config import ModelConfig
from edgemoe.models.registry import common_fields

MODEL_TYPE = "olmoe"


def normalise(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **common_fields(hf),
        intermediate_size=0,
        num_experts=hf["num_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        moe_layers=(True,) * hf["num_hidden_layers"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm="full",
        clip_qkv=hf.get("clip_qkv"),
    )


def rename(name: str) -> str:
    return name
