"""Qwen3-MoE: per-head q/k RMSNorm, no shared expert, optional dense layers."""

from __future__ import annotations

from edgemoe.config import ModelConfig
from edgemoe.layers.attention import Attention
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, moe_or_mlp
from edgemoe.models.hf_config import common_fields, gguf_sparse_fields, sparse_layers

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
    )


def rename(name: str) -> str:
    return name


GGUF_ARCH = "qwen3moe"  # llama.cpp's name for the architecture
TOKENIZER_PRE = "qwen2"  # how its tokenizer splits text (llama.cpp's tokenizer.ggml.pre), for random checkpoints
TOOL_FORMAT = "qwen"  # its chat template's tool calls (`edgemoe.tools.chat_templates`), for random checkpoints


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base` plus this family's fields from the
    geometry `g` (a preset of `edgemoe.tools.presets`)."""
    return base | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": g["num_experts"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "intermediate_size": g["intermediate_size"],
        "norm_topk_prob": g.get("norm_topk_prob", True),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "head_dim": g.get("head_dim", g["hidden_size"] // g["num_attention_heads"]),
    }


def gguf_hparams(writer, config: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The keys llama.cpp's converter writes for this architecture beyond every family's (`edgemoe.tools.make_gguf`)."""
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`."""
    return ckpt.common_config() | gguf_sparse_fields(ckpt, renormalise=True) | {"model_type": MODEL_TYPE}


class Qwen3MoeDecoderLayer(DecoderLayer):
    """Attention with a per-head RMSNorm of q and k before RoPE; routed experts, or a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        bias = cfg.qkv_bias
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, bias, bias,
            head_norm_eps=cfg.rms_norm_eps,
        )  # fmt: skip
        self.mlp = moe_or_mlp(cfg, self)


LAYER = Qwen3MoeDecoderLayer
