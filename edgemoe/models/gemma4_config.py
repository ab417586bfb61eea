"""Gemma-4 text's config: transformers' `Gemma4TextConfig` (or a multimodal `gemma4` config's `text_config`) ->
`ModelConfig`, or a one-line refusal naming the field it cannot serve.

Gemma-only settings live in `Gemma4Settings` (`ModelConfig.family_config`): a dozen fields no other family reads
would only clutter the shared config. The per-layer KV shapes and KV sharing are shared fields (`kv_shapes`,
`kv_sources`), since the engine's KV cache reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.mlp import ACTIVATIONS
from edgemoe.models.hf_config import common_fields

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
        p = (g["rope_parameters"] or _DEFAULTS["rope_parameters"]).get(t)
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
