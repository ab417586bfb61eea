"""What every family shares: the embedding, the layer loop, the final norm and the lm_head, plus `DecoderLayer`,
the pre-norm block (attention, then an MLP or MoE block) whose parts each family chooses in its own file.

Module names follow Hugging Face, so the loader is a small renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.layers.attention import Attention
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.mlp import GatedMLP
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.mtp import MTPHead
from edgemoe.moe.layer import SparseMoE


class DecoderLayer(nn.Module):
    """A pre-norm block carrying the residual. A family's subclass sets `self_attn` (an `Attention`) and `mlp` (a
    `SparseMoE` or a `GatedMLP`) in its constructor, after calling this one."""

    self_attn: Attention
    mlp: SparseMoE | GatedMLP

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_moe = cfg.moe_layers[layer]
        self.moe_layer = sum(cfg.moe_layers[:layer])  # this layer's place among the MoE layers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` is the previous block's output and `residual` the hidden state it adds to (None at the first layer,
        whose x is the embedding). Each add happens in the next norm (one launch with kernels; in decode the MoE
        router's gate GEMV runs the second, and on GPUs without PDL the qkv GEMV the first), so this returns
        (mlp output, hidden state before it): their sum is the layer's output."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
            x = self.self_attn(x, positions)
        elif self.self_attn.fuses_norm(x, residual, self.input_layernorm):
            x, residual = self.self_attn.add_norm_forward(x, residual, self.input_layernorm, positions)
        else:
            x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(x, positions)
        if self.is_moe and self.mlp.fuses_norm(x, self.post_attention_layernorm):
            return self.mlp.add_norm_forward(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def moe_or_mlp(cfg: ModelConfig, layer: DecoderLayer, shared: int = 0) -> SparseMoE | GatedMLP:
    """The routed-expert block of a MoE layer (with a `shared` expert of that width), else the dense MLP."""
    if not layer.is_moe:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
    return SparseMoE(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.top_k,
        cfg.moe_intermediate_size,
        cfg.norm_topk_prob,
        layer.moe_layer,
        shared,
    )


class DecoderModel(nn.Module):
    """Embedding, layers, final norm. A family whose embedding or layer loop differs (Gemma-4: a scaled embedding,
    per-layer embeddings handed to each layer, RoPE per layer type) subclasses it and names the subclass in its
    `MoEForCausalLM` subclass's `model_class`."""

    def __init__(self, cfg: ModelConfig, layer_class: type[DecoderLayer]) -> None:
        super().__init__()
        self.rotary = self.make_rotary(cfg)
        # _weight skips Embedding's random init, which on the meta device pulls in torch._dynamo (~1 s)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(layer_class(cfg, i, self.rotary) for i in range(cfg.num_layers))
        self.num_decoder_layers = cfg.decoder_layers  # after them, a multi-token-prediction head's (not run here)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def make_rotary(cfg: ModelConfig) -> nn.Module:
        """The RoPE module every layer is given (built by the loader with `build(device)`)."""
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rotary_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [tokens, hidden]
        for layer in self.layers[: self.num_decoder_layers]:
            x, residual = layer(x, positions, residual)
        x, _ = self.norm(x, residual)
        return x


class MoEForCausalLM(nn.Module):
    """Token ids + positions of a flattened batch -> final hidden states; `logits` on chosen rows. A family subclasses
    it (its file's `MODEL`) to change the decoder (`model_class`), the multi-token-prediction head (`mtp_class`), the
    logits or `checkpoint_name`."""

    model_class: type[DecoderModel] = DecoderModel
    mtp_class: type[MTPHead] = MTPHead  # the multi-token-prediction head, where the config has its layers

    def __init__(self, cfg: ModelConfig, layer_class: type[DecoderLayer]) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, layer_class)
        self.lm_head = DecodeLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = self.mtp_class(cfg) if cfg.mtp_layers else None  # its layers: the last of self.model.layers

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's parameter name here, after the family's `rename`, where it depends on the config
        (this model's); None: a tensor the model does not use. Default: the name itself."""
        return name

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A safetensors checkpoint's tensor (under its name here) as the tensors this model holds: a family whose
        checkpoints store a weight otherwise (offset norms, projections laid out apart) converts it. Default: as
        is."""
        return [(name, tensor)]
