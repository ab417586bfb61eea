"""Gemma-4 text (transformers' `Gemma4TextConfig`, `Gemma4ForCausalLM`; or the text model of a multimodal `gemma4`
checkpoint, its vision and audio towers skipped).

A layer is sandwich-normed (a norm before and after attention and the feed-forward block), scaled by a learned
`layer_scalar`, and optionally adds its per-layer embedding (`edgemoe.layers.ple`). Attention: q/k/v per-head norms
(v without a scale), scaling 1, sliding-window or global layers each with their own RoPE (global: proportional,
partial rotation) and head shape, optionally K = V on global layers, and the last `num_kv_shared_layers` layers
reading an earlier layer's KV cache. With `enable_moe_block` every layer runs routed experts beside its dense MLP.

Gemma-only settings live in `Gemma4Settings` (`ModelConfig.family_config`): a dozen fields no other family reads
would only clutter the shared config; the per-layer KV shapes and sharing are shared fields, since the engine's KV
cache reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.engine.context import get_context
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention, PagedAttention
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.mlp import ACTIVATIONS, GatedMLP
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.ple import PerLayerEmbeddings, scale_in_dtype
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, DecoderModel, MoEForCausalLM
from edgemoe.models.hf_config import common_fields
from edgemoe.moe.layer import SparseMoE
from edgemoe.moe.router import route

MODEL_TYPE = "gemma4_text"
MODEL_TYPES = ("gemma4_text", "gemma4")  # text-only, and multimodal (its `text_config`)
SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma4TextConfig's defaults for the fields a config.json may leave out (transformers applies them too)
_DEFAULTS: dict[str, Any] = dict(
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
    sliding_window=512, final_logit_softcapping=None, use_bidirectional_attention=None,
    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, global_head_dim=512,
    num_global_key_value_heads=None,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
)  # fmt: skip


@dataclass(frozen=True)
class Rope:
    """One layer type's RoPE: `default` rotates every dim; `proportional` the first `partial` of each head's
    frequencies (the rest stay unrotated), all divided by `factor`."""

    kind: str
    theta: float
    partial: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class Gemma4Settings:
    layer_types: tuple[str, ...]  # per layer: SLIDING or FULL
    sliding_window: int
    rope: tuple[tuple[str, Rope], ...]  # (layer type, its RoPE) for each type present
    ple_vocab: int  # per-layer embeddings: the table's rows, and each layer's width (0: none)
    ple_dim: int
    attention_k_eq_v: bool  # global layers: v is k's projection (no v_proj)
    double_wide_mlp: bool  # KV-shared layers' dense MLP twice as wide
    final_logit_softcapping: float | None


def _refuse(field: str, value: object, why: str) -> EdgeMoEError:
    return EdgeMoEError(f"gemma4: {field} = {value!r} is not supported ({why})")


def _text_config(hf: dict) -> dict:
    """The text model's config with transformers' defaults; a multimodal config's `text_config`, its token ids, tying
    and dtype taken from the top level (where generation_config.json's token ids were merged)."""
    if hf["model_type"] == "gemma4":
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise EdgeMoEError("gemma4: a multimodal config without a text_config object: no text model to load")
        top = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "dtype", "torch_dtype")
        hf = {**text, **{k: hf[k] for k in top if k in hf}, "model_type": MODEL_TYPE}
    return {**_DEFAULTS, **hf}


def _layer_types(g: dict) -> tuple[str, ...]:
    n = g["num_hidden_layers"]
    types = list(g.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if len(types) != n or bad:
        raise _refuse("layer_types", bad or types, f"{n} entries of {SLIDING} or {FULL}")
    types[-1] = FULL  # transformers forces the last layer global
    return tuple(types)


def _kv_shapes(g: dict, types: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """Per layer (kv_heads, head_dim): `per_layer_config` where given (as transformers saves it), else global layers
    take `global_head_dim` and, with K = V, `num_global_key_value_heads`."""
    base = (g["num_key_value_heads"], g["head_dim"])
    overrides = g.get("per_layer_config")
    if overrides is None:
        kv = g["num_global_key_value_heads"] if g["attention_k_eq_v"] else None
        overrides = {i: {"head_dim": g["global_head_dim"], **({} if kv is None else {"num_key_value_heads": kv})}
                     for i, t in enumerate(types) if t == FULL}  # fmt: skip
    shapes = [base] * len(types)
    for key, o in overrides.items():
        extra = set(o) - {"head_dim", "num_key_value_heads"}
        if extra or not str(key).isdigit() or int(key) >= len(types):
            raise _refuse("per_layer_config", {key: o}, "only head_dim and num_key_value_heads per layer index")
        shapes[int(key)] = (o.get("num_key_value_heads", base[0]), o.get("head_dim", base[1]))
    for t in set(types):
        dims = {shapes[i][1] for i in range(len(types)) if types[i] == t}
        if len(dims) > 1:
            raise _refuse("per_layer_config", sorted(dims), f"{t} layers of different head_dim share one RoPE")
    return tuple(shapes)


def _kv_sources(shared: int, types: tuple[str, ...]) -> tuple[int, ...]:
    """The last `shared` layers read the KV cache of the last earlier layer of their type (transformers'
    `kv_sharing_modes`)."""
    first = len(types) - shared
    if not 0 <= shared < len(types):
        raise _refuse("num_kv_shared_layers", shared, f"fewer than num_hidden_layers {len(types)} and >= 0")
    sources = list(range(len(types)))
    for i in range(first, len(types)):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise _refuse("num_kv_shared_layers", shared, f"no earlier {types[i]} layer to share its KV cache")
        sources[i] = own[-1]
    return tuple(sources)


def _rope(g: dict, types: tuple[str, ...]) -> tuple[tuple[str, Rope], ...]:
    out = []
    for t in sorted(set(types)):
        p = (g["rope_parameters"] or {}).get(t)
        kind = (p or {}).get("rope_type", "default")
        if not isinstance(p, dict) or kind not in ("default", "proportional"):
            raise _refuse(f"rope_parameters[{t!r}]", p, "rope_type default or proportional")
        partial = float(p.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
        factor = float(p.get("factor", 1.0)) if kind == "proportional" else 1.0
        out.append((t, Rope(kind, float(p["rope_theta"]), partial, factor)))
    return tuple(out)


def normalise(hf: dict) -> ModelConfig:
    g = _text_config(hf)
    if g["hidden_activation"] not in ACTIVATIONS:
        raise _refuse("hidden_activation", g["hidden_activation"], f"use one of {', '.join(ACTIVATIONS)}")
    if g["use_bidirectional_attention"] not in (None, "vision"):  # "vision" changes image tokens only
        raise _refuse("use_bidirectional_attention", g["use_bidirectional_attention"], "causal text attention only")
    types = _layer_types(g)
    moe, bias, ple = bool(g["enable_moe_block"]), bool(g["attention_bias"]), g["hidden_size_per_layer_input"] or 0
    fields = common_fields(g)
    rope = _rope(g, types)
    fields["rope_theta"] = rope[-1][1].theta  # informational: each layer type has its own
    experts = [(g.get(k) or 0) if moe else 0 for k in ("num_experts", "top_k_experts", "moe_intermediate_size")]
    return ModelConfig(
        **fields,
        intermediate_size=g["intermediate_size"],
        num_experts=experts[0],
        top_k=experts[1],
        moe_intermediate_size=experts[2],
        moe_layers=(moe,) * g["num_hidden_layers"],
        norm_topk_prob=True,
        qkv_bias=bias,
        o_proj_bias=bias,
        hidden_act=g["hidden_activation"],
        kv_shapes=_kv_shapes(g, types),
        kv_sources=_kv_sources(g["num_kv_shared_layers"] or 0, types),
        family_config=Gemma4Settings(
            layer_types=types,
            sliding_window=g["sliding_window"],
            rope=rope,
            ple_vocab=g["vocab_size_per_layer_input"] if ple else 0,
            ple_dim=ple,
            attention_k_eq_v=bool(g["attention_k_eq_v"]),
            double_wide_mlp=bool(g["use_double_wide_mlp"]),
            final_logit_softcapping=g["final_logit_softcapping"],
        ),
    )


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
    """Scaling 1 (q and k are normed); a sliding layer sees only the last `window` keys. Sliding layers keep the
    torch decode on every device: the Triton decode kernel cannot window."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        self.scale, self.window = 1.0, window

    def use_kernels(self, device: torch.device) -> None:
        if self.window is None:
            super().use_kernels(device)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        seen = k_pos <= q_pos
        return seen if self.window is None else seen & (k_pos > q_pos - self.window)


class Gemma4Attention(Attention):
    """q, k RMS-normed per head and v normed without a scale before RoPE; K = V on global layers with
    `attention_k_eq_v` (no v rows in `qkv_proj`); a KV-shared layer projects q only and attends over the KV cache of
    the layer it shares (bound to it by the KV cache), writing none. The prologue stays plain torch on every device
    (the fused prologue kernel has no v norm)."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Gemma4Rotaries, block_size: int) -> None:
        s = cfg.family_config
        source, kv_heads, d = cfg.kv_layers()[layer]
        kind = s.layer_types[layer]
        super().__init__(
            cfg.hidden_size, cfg.num_heads, kv_heads, d, rotary.types[kind], block_size, cfg.qkv_bias, cfg.o_proj_bias,
            head_norm_eps=cfg.rms_norm_eps,
        )  # fmt: skip
        self.shares_kv, self.k_eq_v, self.eps = source != layer, s.attention_k_eq_v and kind == FULL, cfg.rms_norm_eps
        kv = 0 if self.shares_kv else kv_heads * d
        self.qkv_sizes = [cfg.num_heads * d, kv, 0 if self.k_eq_v else kv]
        self.qkv_proj = DecodeLinear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        if self.shares_kv:
            self.k_norm = None
        window = s.sliding_window if kind == SLIDING else None
        self.attn = Gemma4PagedAttention(cfg.num_heads, kv_heads, d, block_size, window)

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

    def __init__(self, cfg: ModelConfig, index: int, dense: GatedMLP) -> None:
        H, E, eps = cfg.hidden_size, cfg.num_experts, cfg.rms_norm_eps
        super().__init__(H, E, cfg.top_k, cfg.moe_intermediate_size, True, index, act=cfg.hidden_act)
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

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Gemma4Rotaries, block_size: int) -> None:
        super().__init__(cfg, layer)
        s, H, eps = cfg.family_config, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, layer, rotary, block_size)
        wide = s.double_wide_mlp and self.self_attn.shares_kv
        dense = GatedMLP(H, cfg.intermediate_size * (2 if wide else 1), cfg.hidden_act)
        if self.is_moe:
            self.mlp = Gemma4MoE(cfg, self.moe_index, dense)  # it owns the pre-feed-forward norms
        else:
            self.mlp, self.pre_feedforward_layernorm = dense, RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.act = ACTIVATIONS[cfg.hidden_act]
        if s.ple_dim:
            self.per_layer_input_gate = nn.Linear(H, s.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(s.ple_dim, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, positions: torch.Tensor, per_layer_input: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [tokens, hidden]; per_layer_input: this layer's [tokens, ple_dim], None without PLE."""
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions))
        ff = self.mlp(h) if self.is_moe else self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(ff)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4Model(DecoderModel):
    """The embedding scaled by sqrt(hidden); the per-layer inputs computed once per step (the PLE backend's rows
    mixed with a normed projection of the embedding) and handed to each layer; RoPE per layer type."""

    def __init__(self, cfg: ModelConfig, layer_class: type[DecoderLayer], block_size: int) -> None:
        super().__init__(cfg, layer_class, block_size)
        s, H = cfg.family_config, cfg.hidden_size
        self.hidden, self.ple_dim = H, s.ple_dim
        self.embed_tokens_per_layer: PerLayerEmbeddings | None = None
        if s.ple_dim:
            self.embed_tokens_per_layer = PerLayerEmbeddings(s.ple_vocab, cfg.num_layers, s.ple_dim)
            self.per_layer_model_projection = nn.Linear(H, cfg.num_layers * s.ple_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(s.ple_dim, cfg.rms_norm_eps)

    @staticmethod
    def make_rotary(cfg: ModelConfig) -> nn.Module:
        return Gemma4Rotaries(cfg)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[tokens] ids and their scaled embedding [tokens, hidden] -> [tokens, layers, ple_dim]."""
        proj = self.per_layer_model_projection(x) * self.hidden**-0.5
        proj = self.per_layer_projection_norm(proj.view(x.shape[0], -1, self.ple_dim))
        return (proj + self.embed_tokens_per_layer.rows(input_ids)) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = scale_in_dtype(self.embed_tokens(input_ids), self.hidden**0.5)  # [tokens, hidden]
        ple = None if self.embed_tokens_per_layer is None else self.per_layer_inputs(input_ids, x)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, None if ple is None else ple[:, i])
        return self.norm(x)


_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_KV = re.compile(r"^self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")
_MOE = re.compile(r"^(router\.|experts\.|pre_feedforward_layernorm|post_feedforward_layernorm_|mlp\.)")


class Gemma4ForCausalLM(MoEForCausalLM):
    """Logits soft-capped (cap * tanh(logits / cap)) where the config asks."""

    model_class = Gemma4Model

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, cap = self.lm_head(hidden), self.config.family_config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def checkpoint_name(self, name: str) -> str | None:
        """Vision and audio towers, and KV-shared layers' k/v weights (some checkpoints keep them), are not used; in
        MoE layers the router, the experts, the dense MLP and the norms of its branches are the `Gemma4MoE`'s."""
        m = _LAYER.match(name)
        if name.startswith(_TOWERS) or m and self.config.kv_layers()[int(m[1])][0] != int(m[1]) and _KV.match(m[2]):
            return None
        if not m or not self.config.moe_layers[int(m[1])] or not _MOE.match(m[2]):
            return name
        rest = m[2].replace("router.proj.", "gate.").replace("router.scale", "router_scale")
        rest = rest.replace("router.per_expert_scale", "per_expert_scale").replace("mlp.", "shared_expert.", 1)
        return f"model.layers.{m[1]}.mlp.{rest}"


LAYER = Gemma4DecoderLayer
MODEL = Gemma4ForCausalLM
