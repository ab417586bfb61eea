"""OLMoE: q/k RMSNorm over all heads (before RoPE), optional qkv clipping, every layer sparse."""

from __future__ import annotations

import torch

from edgemoe.config import ModelConfig
from edgemoe.layers.attention import Attention
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, moe_or_mlp
from edgemoe.models.hf_config import common_fields

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
        clip_qkv=hf.get("clip_qkv"),
    )


def rename(name: str) -> str:
    return name


class OlmoeAttention(Attention):
    """q and k RMS-normed over all heads (not per head), then optionally every projection clipped, before RoPE."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        bias = cfg.qkv_bias
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, bias, bias)
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.clip = cfg.clip_qkv

    def transform_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return q, k, v


class OlmoeDecoderLayer(DecoderLayer):
    """OLMoE's attention; routed experts in every layer."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        self.self_attn = OlmoeAttention(cfg, rotary)
        self.mlp = moe_or_mlp(cfg, self)


LAYER = OlmoeDecoderLayer
