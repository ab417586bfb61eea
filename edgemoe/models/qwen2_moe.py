"""Qwen2-MoE (Qwen1.5-MoE): qkv bias, a sigmoid-gated shared expert, optional dense layers."""

from __future__ import annotations

from edgemoe.config import ModelConfig
from edgemoe.models.registry import common_fields, sparse_layers

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
