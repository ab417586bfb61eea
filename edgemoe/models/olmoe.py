"""OLMoE: q/k RMSNorm over all heads (before RoPE), optional qkv clipping, every layer sparse."""

from __future__ import annotations

from dataclasses import dataclass

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
        family_config=OlmoeSettings(clip_qkv=hf.get("clip_qkv")),
    )


@dataclass(frozen=True)
class OlmoeSettings:
    """What only OLMoE reads (`ModelConfig.family_config`): q, k and v clamped to +-clip_qkv where set."""

    clip_qkv: float | None = None


GGUF_ARCH = "olmoe"  # llama.cpp's name for the architecture
TOKENIZER_PRE = "gpt-2"  # how its tokenizer splits text (llama.cpp's tokenizer.ggml.pre), for random checkpoints
TOOL_FORMAT = "qwen"  # OLMoE's chat models have no tool format of their own: Qwen's (Hermes') is the common one


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base` plus this family's fields from the
    geometry `g` (a preset of `edgemoe.tools.presets`)."""
    return base | {
        "architectures": ["OlmoeForCausalLM"],
        "num_experts": g["num_experts"],
        "intermediate_size": g["moe_intermediate_size"],
        "norm_topk_prob": False,
        "clip_qkv": None,
    }


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`: every layer sparse, the experts' width as
    feed_forward_length, q/k/v clamped where the file says."""
    clip = ckpt.field("olmoe.attention.clamp_kqv", None)
    fields = dict(
        num_experts=int(ckpt.field("olmoe.expert_count")),
        intermediate_size=int(ckpt.field("olmoe.feed_forward_length")),
        attention_bias=ckpt.has("blk.0.attn_q.bias"),
        clip_qkv=None if clip is None else float(clip),
    )
    return ckpt.common_config() | fields | {"model_type": MODEL_TYPE}


# tensor parallelism (`edgemoe.engine.parallel.Cut`): the q/k norms' weights span every head, split with them
SPLIT_WITH_HEADS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


def rename(name: str) -> str:
    return name


class OlmoeAttention(Attention):
    """q and k RMS-normed over all heads (not per head), then optionally every projection clipped, before RoPE."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        bias = cfg.qkv_bias
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, bias, bias)
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.clip = cfg.family_config.clip_qkv

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
