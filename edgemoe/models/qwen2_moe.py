"""Qwen2-MoE (Qwen1.5-MoE): qkv bias, a sigmoid-gated shared expert, optional dense layers."""

from __future__ import annotations

import torch

from edgemoe.config import ModelConfig
from edgemoe.layers.attention import Attention
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, MoEForCausalLM, moe_or_mlp
from edgemoe.models.hf_config import common_fields, gguf_sparse_fields, sparse_layers

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


GGUF_ARCH = "qwen2moe"  # llama.cpp's name for the architecture
TOKENIZER_PRE = "qwen2"  # how its tokenizer splits text (llama.cpp's tokenizer.ggml.pre), for random checkpoints
TOOL_FORMAT = "qwen"  # its chat template's tool calls (`edgemoe.tools.chat_templates`), for random checkpoints


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base` plus this family's fields from the
    geometry `g` (a preset of `edgemoe.tools.presets`)."""
    return base | {
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_experts": g["num_experts"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "intermediate_size": g["intermediate_size"],
        "shared_expert_intermediate_size": g.get("shared_expert_intermediate_size", 0),
        "norm_topk_prob": g.get("norm_topk_prob", False),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": True,
    }


def gguf_hparams(writer, config: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The keys llama.cpp's converter writes for this architecture beyond every family's (`edgemoe.tools.make_gguf`)."""
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def gguf_tensors(name: str, t: torch.Tensor, config: dict) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as make-model's GGUF file holds it (`edgemoe.tools.make_gguf`): the shared expert's gate
    [1, H] as [H], as the converter once wrote it. The converter now keeps [1, H], which transformers' GGUF loader (the
    oracle of tests/models/test_gguf.py) cannot read; tests/models/test_llama_converter.py loads that form."""
    if name.endswith(".shared_expert_gate.weight"):
        return [(name, t.reshape(-1))]
    return [(name, t)]


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`: the shared expert's width from its metadata, else from its
    tensor (older converters wrote none)."""
    shared = ckpt.field(f"{GGUF_ARCH}.expert_shared_feed_forward_length", None)
    if shared is None and ckpt.has("blk.0.ffn_up_shexp.weight"):
        shared = int(ckpt.tensors["blk.0.ffn_up_shexp.weight"].shape[1])
    fields = gguf_sparse_fields(ckpt, renormalise=False) | {"shared_expert_intermediate_size": int(shared or 0)}
    return ckpt.common_config() | fields | {"model_type": MODEL_TYPE}


class Qwen2MoeDecoderLayer(DecoderLayer):
    """Attention with qkv bias; routed experts plus a sigmoid-gated shared expert, or a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, qkv_bias=cfg.qkv_bias
        )
        self.mlp = moe_or_mlp(cfg, self, shared=cfg.shared_expert_intermediate_size)


LAYER = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """A checkpoint with `shared_expert_intermediate_size` 0 may carry zero-width shared-expert tensors: unused."""

    def checkpoint_name(self, name: str) -> str | None:
        if ".shared_expert" in name and not self.config.shared_expert_intermediate_size:
            return None
        return name


MODEL = Qwen2MoeForCausalLM
