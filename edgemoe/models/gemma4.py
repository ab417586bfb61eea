"""Gemma-4 text (transformers' `Gemma4TextConfig`, `Gemma4ForCausalLM`; or the text model of a multimodal `gemma4`
checkpoint, its vision and audio towers skipped).

A layer is sandwich-normed (a norm before and after attention and the feed-forward block), scaled by a learned
`layer_scalar`, and optionally adds its per-layer embedding (`edgemoe.layers.ple`). Attention: q/k/v per-head norms
(v without a scale), scaling 1, sliding-window or global layers each with their own RoPE (global: proportional,
partial rotation) and head shape, optionally K = V on global layers, and the last `num_kv_shared_layers` layers
reading an earlier layer's KV cache. With `enable_moe_block` every layer runs routed experts beside its dense MLP.
The config's normalisation (and its refusals) is `gemma4_config`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.context import get_context
from edgemoe.layers.attention import Attention, PagedAttention
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.mlp import ACTIVATIONS, GatedMLP
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.ple import PerLayerEmbeddings, PLEBackend, scale_in_dtype
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, DecoderModel, MoEForCausalLM
from edgemoe.models.gemma4_config import FULL, MODEL_TYPE, MODEL_TYPES, SLIDING, Rope, normalise
from edgemoe.moe.layer import SparseMoE
from edgemoe.moe.router import route

__all__ = ["LAYER", "MODEL", "MODEL_TYPE", "MODEL_TYPES", "normalise", "rename"]  # the family's interface


def rename(name: str) -> str:
    """A multimodal checkpoint keeps the text model under `model.language_model.`."""
    return "model." + name[len("model.language_model.") :] if name.startswith("model.language_model.") else name


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a scale (Gemma's v norm and router norm), computed in float32."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Rotary(RotaryEmbedding):
    """RoPE of one layer type; `proportional` rotates the first `partial` of the frequencies (transformers'
    `_compute_proportional_rope_parameters`)."""

    def __init__(self, head_dim: int, max_positions: int, rope: Rope) -> None:
        super().__init__(head_dim, max_positions, rope.theta)
        self.rope = rope

    def inv_freq(self) -> torch.Tensor:
        if self.rope.kind == "default":
            return super().inv_freq()
        angles = int(self.rope.partial * self.head_dim // 2)
        rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / self.head_dim))
        return torch.cat((rotated, torch.zeros(self.head_dim // 2 - angles))) / self.rope.factor


class Gemma4Rotaries(nn.Module):
    """One RoPE table per layer type present (`DecoderModel.make_rotary`); a layer takes its type's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        s, shapes = cfg.family_config, cfg.kv_layers()
        dims = {t: shapes[s.layer_types.index(t)][2] for t, _ in s.rope}
        self.types = nn.ModuleDict({t: Gemma4Rotary(dims[t], cfg.max_position_embeddings, r) for t, r in s.rope})

    def build(self, device: torch.device | str) -> None:
        for rotary in self.types.values():
            rotary.build(device)


class Gemma4PagedAttention(PagedAttention):
    """Scaling 1 (q and k are normed); a sliding layer sees only the last `window` keys (on CUDA the Triton decode
    kernel reads only those)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, window)
        self.scale = 1.0


class Gemma4Attention(Attention):
    """q, k RMS-normed per head and v normed without a scale before RoPE; K = V on global layers with
    `attention_k_eq_v` (no v rows in `qkv_proj`); a KV-shared layer projects q only and attends over the KV cache of
    the layer it shares (bound to it by the KV cache), writing none. The prologue stays plain torch on every device
    (the fused prologue kernel has no v norm)."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Gemma4Rotaries) -> None:
        s = cfg.family_config
        source, kv_heads, d = cfg.kv_layers()[layer]  # every Gemma-4 layer attends
        kind = s.layer_types[layer]
        super().__init__(
            cfg.hidden_size, cfg.num_heads, kv_heads, d, rotary.types[kind], cfg.qkv_bias, cfg.o_proj_bias,
            head_norm_eps=cfg.rms_norm_eps,
        )  # fmt: skip
        self.shares_kv, self.k_eq_v, self.eps = source != layer, s.attention_k_eq_v and kind == FULL, cfg.rms_norm_eps
        kv = 0 if self.shares_kv else kv_heads * d
        self.qkv_sizes = [cfg.num_heads * d, kv, 0 if self.k_eq_v else kv]
        self.qkv_proj = DecodeLinear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        if self.shares_kv:
            self.k_norm = None
        window = s.sliding_window if kind == SLIDING else None
        self.attn = Gemma4PagedAttention(cfg.num_heads, kv_heads, d, window)

    def use_kernels(self, device: torch.device) -> None:
        pass  # no fused prologue or norm-in-GEMV (see the class); qkv_proj and o_proj still take the GEMV kernel

    def forward(self, x: torch.Tensor, positions: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # [tokens, heads * head_dim] (k, v may be empty)
        q = self.q_norm(q.view(-1, self.nq, self.d))
        if self.shares_kv:
            q, _ = self.rotary[0](positions, q, q[:, :1])  # k and v are the shared layer's, already cached
        else:
            k = k.view(-1, self.nkv, self.d)
            v = _normalize(k if self.k_eq_v else v.view(-1, self.nkv, self.d), self.eps)  # v: k's raw projection
            q, k = self.rotary[0](positions, q, self.k_norm(k))
            self.attn.write_kv(k, v)
        return self.o_proj(self.attn.attend(q))


class Gemma4MoE(SparseMoE):
    """The feed-forward block with `enable_moe_block`: the dense MLP (`shared_expert`, so it can run on the side
    stream) beside the routed experts, each branch with its own norms, both fed the residual stream. The router norms
    its input without a scale, scales it (`router_scale`, 1/sqrt(hidden)), softmaxes, keeps and renormalises the
    top k, then weighs each by its expert's `per_expert_scale`; no router kernel does that yet."""

    def __init__(self, cfg: ModelConfig, moe_layer: int, dense: GatedMLP) -> None:
        H, E, eps = cfg.hidden_size, cfg.num_experts, cfg.rms_norm_eps
        super().__init__(H, E, cfg.top_k, cfg.moe_intermediate_size, True, moe_layer, act=cfg.hidden_act)
        self.shared_expert, self.eps, self.root = dense, eps, H**-0.5
        self.router_scale = nn.Parameter(torch.ones(H))
        self.per_expert_scale = nn.Parameter(torch.ones(E))
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm_1 = RMSNorm(H, eps), RMSNorm(H, eps)
        self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_2 = RMSNorm(H, eps), RMSNorm(H, eps)

    def use_kernels(self, device: torch.device) -> None:
        pass

    def fuses_norm(self, x: torch.Tensor, norm: RMSNorm) -> bool:
        return False

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream [tokens, hidden] -> (ids, weights) [tokens, top_k]; padding rows reuse row 0's."""
        ids, weights = route(self.gate(_normalize(h, self.eps) * self.router_scale * self.root), self.top_k, True)
        valid = get_context().valid
        if valid is not None:
            ids = torch.where(valid[:, None], ids, ids[:1])
        return ids, weights * self.per_expert_scale[ids]

    def _routed(self, h: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        ids, weights = self.route(h) if routing is None else routing
        out = self.experts(self.pre_feedforward_layernorm_2(h), self.routed(ids), weights)
        return self.post_feedforward_layernorm_2(out)

    def _shared(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm_1(self.shared_expert(self.pre_feedforward_layernorm(h)))


class Gemma4DecoderLayer(DecoderLayer):
    """Sandwich norms around attention and the feed-forward block (a dense MLP, or `Gemma4MoE`), then the per-layer
    embedding's gated projection, then `layer_scalar`. Takes and returns the hidden state itself (no split
    residual): `Gemma4Model` runs the loop."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Gemma4Rotaries) -> None:
        super().__init__(cfg, layer)
        s, H, eps = cfg.family_config, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, layer, rotary)
        wide = s.double_wide_mlp and self.self_attn.shares_kv
        dense = GatedMLP(H, cfg.intermediate_size * (2 if wide else 1), cfg.hidden_act)
        if self.is_moe:
            self.mlp = Gemma4MoE(cfg, self.moe_layer, dense)  # it owns the pre-feed-forward norms
        else:
            self.mlp, self.pre_feedforward_layernorm = dense, RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.act = ACTIVATIONS[cfg.hidden_act]
        if s.ple_dim:
            self.per_layer_input_gate = DecodeLinear(H, s.ple_dim, bias=False)
            self.per_layer_projection = DecodeLinear(s.ple_dim, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, positions: torch.Tensor, per_layer_input: Callable[[], torch.Tensor] | None
    ) -> torch.Tensor:
        """x: [tokens, hidden]; per_layer_input: returns this layer's [tokens, ple_dim] (called where it is first
        needed, after attention and the feed-forward block: `Gemma4Model.per_layer_inputs`), None without PLE."""
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions))
        ff = self.mlp(h) if self.is_moe else self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(ff)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input()
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4Model(DecoderModel):
    """The embedding scaled by sqrt(hidden); the per-layer inputs computed once per step (the PLE backend's rows
    mixed with a normed projection of the embedding), where the first layer needs them, and handed to each layer;
    RoPE per layer type."""

    def __init__(self, cfg: ModelConfig, layer_class: type[DecoderLayer]) -> None:
        super().__init__(cfg, layer_class)
        s, H = cfg.family_config, cfg.hidden_size
        self.hidden, self.ple_dim = H, s.ple_dim
        self.embed_tokens_per_layer: PLEBackend | None = None  # the family builds `gpu`; the loader may swap it
        if s.ple_dim:
            self.embed_tokens_per_layer = PerLayerEmbeddings(s.ple_vocab, cfg.num_layers, s.ple_dim)
            self.per_layer_model_projection = DecodeLinear(H, cfg.num_layers * s.ple_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(s.ple_dim, cfg.rms_norm_eps)

    @staticmethod
    def make_rotary(cfg: ModelConfig) -> nn.Module:
        return Gemma4Rotaries(cfg)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
        """[tokens] ids and their scaled embedding [tokens, hidden] -> layer i -> its per-layer input [tokens,
        ple_dim]. The normed projection of the embedding is computed now, the backend's rows (and their mix with it,
        for every layer at once) at the first call: the first layer's, after its attention and feed-forward block.
        A wait-sync backend's graph waits for its rows there (`edgemoe.layers.ple_disk`), so the host's read of them
        hides behind that layer too, not only behind the embedding."""
        proj = self.per_layer_model_projection(x) * self.hidden**-0.5
        proj = self.per_layer_projection_norm(proj.view(x.shape[0], -1, self.ple_dim))
        mixed: list[torch.Tensor] = []

        def layer_input(i: int) -> torch.Tensor:
            if not mixed:
                mixed.append((proj + self.embed_tokens_per_layer.rows(input_ids)) * 2.0**-0.5)
            return mixed[0][:, i]

        return layer_input

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = scale_in_dtype(self.embed_tokens(input_ids), self.hidden**0.5)  # [tokens, hidden]
        ple = None if self.embed_tokens_per_layer is None else self.per_layer_inputs(input_ids, x)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, None if ple is None else functools.partial(ple, i))
        return self.norm(x)


_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_KV = re.compile(r"^self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")
# A MoE layer's names -> its Gemma4MoE's (the prefix they start with -> ours)
_MOE = (
    ("router.proj.", "gate."), ("router.scale", "router_scale"), ("router.per_expert_scale", "per_expert_scale"),
    ("mlp.", "shared_expert."), ("experts.", "experts."), ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
    ("post_feedforward_layernorm_", "post_feedforward_layernorm_"),
)  # fmt: skip


class Gemma4ForCausalLM(MoEForCausalLM):
    """Logits soft-capped (cap * tanh(logits / cap)) where the config asks."""

    model_class = Gemma4Model

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, cap = self.lm_head(hidden), self.config.family_config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def checkpoint_name(self, name: str) -> str | None:
        """Vision and audio towers are not used, nor KV-shared layers' k/v weights (transformers ignores them where a
        checkpoint has them); in MoE layers the router, the experts, the dense MLP and its branches' norms belong to
        the `Gemma4MoE`."""
        m = _LAYER.match(name)
        if name.startswith(_TOWERS) or m and self.config.kv_layers()[int(m[1])][0] != int(m[1]) and _KV.match(m[2]):
            return None
        if m and self.config.moe_layers[int(m[1])]:
            for theirs, ours in _MOE:
                if m[2].startswith(theirs):
                    return f"model.layers.{m[1]}.mlp.{ours}{m[2][len(theirs) :]}"
        return name


LAYER = Gemma4DecoderLayer
MODEL = Gemma4ForCausalLM
