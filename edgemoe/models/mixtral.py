"""Mixtral: every layer sparse, top-k weights always renormalised, `block_sparse_moe` names."""

from __future__ import annotations

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, moe_or_mlp
from edgemoe.models.hf_config import common_fields

MODEL_TYPE = "mixtral"


def normalise(hf: dict) -> ModelConfig:
    fields = common_fields(hf)
    window = hf.get("sliding_window")
    if window is not None and window < fields["max_position_embeddings"]:
        fields["max_position_embeddings"] = window  # within the window, attention is plain causal
    if hf.get("num_local_experts", 0) < 1:
        raise EdgeMoEError("mixtral config needs num_local_experts >= 1")
    return ModelConfig(
        **fields,
        intermediate_size=0,
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        moe_layers=(True,) * hf["num_hidden_layers"],
        norm_topk_prob=True,
    )


def rename(name: str) -> str:
    return name.replace(".block_sparse_moe.", ".mlp.")


class MixtralDecoderLayer(DecoderLayer):
    """Plain attention; routed experts in every layer."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary)
        self.mlp = moe_or_mlp(cfg, self)


LAYER = MixtralDecoderLayer
