"""Qwen3-MoE: per-head q/k RMSNorm, no shared expert, optional dense layers."""

from __future__ import annotations

from edgemoe.config import ModelConfig
from edgemoe.models.registry import common_fields, sparse_layers

MODEL_TYPE = "qwen3_moe"


def normalise(hf: dict) -> ModelConfig:
    experts = hf.get("num_experts") or hf["num_local_experts"]
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **common_fields(hf),
        intermediate_size=hf.get("intermediate_size", 0),
        num_experts=experts,
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        moe_layers=sparse_layers(hf, experts),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm="head",
    )


def rename(name: str) -> str:
    return name
