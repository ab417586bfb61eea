"""OpenAI gpt-oss (transformers' `GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b).

Attention with q/k/v and output biases and a learnt sink logit per head, sliding-window (`sliding_window`, 128) and
full-attention layers as `layer_types` says, YaRN RoPE. Every layer routes: a router with a bias keeps the top k
logits and softmaxes over them alone; experts with biases and a clamped SwiGLU (`edgemoe.layers.mlp.swiglu_oai`), no
shared expert. The Hub's checkpoints store the experts as MXFP4 (`*_blocks`, `*_scales`, with a `quantization_config`
of method mxfp4): `convert` repacks their bytes into `edgemoe.quant`'s MXFP4 blocks, which the loader keeps as they
are (`ModelConfig.expert_format`); a checkpoint of float experts (transformers' own save of a dequantized model) is
read too. transformers stores an expert's gate and up rows interleaved (even rows gate, odd rows up) and its float
weights transposed; `convert` lays them out as every family's.

On CUDA the attention of every layer (sinks; sliding windows) decodes with the Triton paged-attention kernel, and the
experts (their biases and clamped SwiGLU) run the expert kernels, MXFP4 as stored, in decode and prefill; prefill
attention with sinks and the router stay plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.context import get_context
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention, PagedAttention
from edgemoe.layers.mlp import SWIGLU_ALPHA, SWIGLU_LIMIT, SWIGLU_OAI
from edgemoe.layers.rotary import RotaryEmbedding, YarnRotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, DecoderModel, MoEForCausalLM
from edgemoe.models.hf_config import common_fields
from edgemoe.moe.experts import Experts
from edgemoe.moe.layer import SparseMoE
from edgemoe.moe.router import route
from edgemoe.quant import mxfp4_from_packed

MODEL_TYPE = "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"
_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096)  # fmt: skip
# transformers' defaults (`GptOssConfig`) for the fields a config.json may leave out
_DEFAULTS: dict[str, Any] = dict(num_local_experts=128, num_experts_per_tok=4, head_dim=64, num_key_value_heads=8,
                                 sliding_window=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                 attention_bias=True, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT,
                                 rope_theta=150000.0)  # fmt: skip


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters (`YarnRotaryEmbedding`)."""

    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class GptOssSettings:
    layer_types: tuple[str, ...]  # per layer: SLIDING or FULL
    sliding_window: int
    yarn: Yarn | None  # None: the default RoPE


def _refuse(field: str, value: object, why: str) -> EdgeMoEError:
    return EdgeMoEError(f"gpt_oss: {field} = {value!r} is not supported ({why})")


def _yarn(rope: dict) -> Yarn | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise _refuse("rope_type", kind, "yarn or default")
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            raise _refuse(key, rope[key], "YaRN's attention factor from the factor alone, or attention_factor")
    return Yarn(
        factor=float(rope["factor"]),
        original_max=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=rope.get("attention_factor"),
    )


def _expert_format(quant: dict | None) -> str | None:
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "mxfp4":
        raise _refuse("quantization_config.quant_method", method, "the Hub's mxfp4 experts, or float weights")
    return "mxfp4"


def normalise(hf: dict) -> ModelConfig:
    hf = {**_DEFAULTS, **hf}
    for field, value in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if float(hf[field]) != value:
            raise _refuse(field, hf[field], f"the experts' activation is gpt-oss's, {field} {value}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or _YARN
    theta = float(rope.get("rope_theta", hf["rope_theta"]))
    fields = common_fields({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": theta}})
    n = fields["num_layers"]
    types = tuple(hf.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n)])
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise _refuse("layer_types", list(types), f"{n} entries, each {SLIDING} or {FULL}")
    window = hf["sliding_window"]
    if SLIDING in types and not (isinstance(window, int) and window >= 1):
        raise _refuse("sliding_window", window, "an integer >= 1")
    inter, bias = hf["intermediate_size"], bool(hf["attention_bias"])
    return ModelConfig(
        **fields,
        intermediate_size=inter,
        num_experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=inter,
        moe_layers=(True,) * n,
        norm_topk_prob=False,  # (moot: the softmax runs over the top k alone)
        qkv_bias=bias,
        o_proj_bias=bias,
        hidden_act=SWIGLU_OAI,
        expert_format=_expert_format(hf.get("quantization_config")),
        family_config=GptOssSettings(types, window or 0, _yarn(rope)),
    )


def rename(name: str) -> str:
    """transformers' `mlp.router` is our `mlp.gate`; its `self_attn.sinks` belong to the paged attention."""
    return name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks", ".self_attn.attn.sinks")


def checkpoint_shapes(shapes: list[tuple[str, tuple[int, ...]]], cfg: ModelConfig) -> list[tuple[str, tuple]]:
    """Our tensors (name, shape) as transformers' checkpoints hold them (`rename` undone, float experts transposed to
    [E, in, out]): for random checkpoints (`edgemoe.tools.random_weights`)."""
    out = []
    for name, shape in shapes:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            shape = (shape[0], shape[2], shape[1])
        out.append(
            (name.replace(".mlp.gate.", ".mlp.router.").replace(".self_attn.attn.sinks", ".self_attn.sinks"), shape)
        )
    return out


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base` plus this family's fields from the
    geometry `g` (a preset of `edgemoe.tools.presets`). gpt-oss has no dense MLP: its `intermediate_size` is the
    experts' width, the preset's `moe_intermediate_size`. YaRN as released (a factor of 32), over the preset's
    `original_max_position_embeddings` or, where it names none, its context / 32, as the released models' 4096 are
    131072 / 32."""
    theta = g.get("rope_theta", _DEFAULTS["rope_theta"])
    original = g.get("original_max_position_embeddings", base["max_position_embeddings"] // int(_YARN["factor"]))
    rope = _YARN | {"original_max_position_embeddings": original, "rope_theta": theta}
    n = base["num_hidden_layers"]
    return base | {
        "architectures": ["GptOssForCausalLM"],
        "num_local_experts": g["num_experts"],
        "intermediate_size": g["moe_intermediate_size"],
        "head_dim": g.get("head_dim", g["hidden_size"] // g["num_attention_heads"]),
        "sliding_window": g.get("sliding_window", _DEFAULTS["sliding_window"]),
        "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(n)],
        "rope_theta": theta,
        "rope_parameters": rope,
        "rms_norm_eps": g.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"]),
        "attention_bias": True,
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": SWIGLU_LIMIT,
    }


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate and up rows interleaved (transformers' order) -> gate rows, then up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOssMoE(SparseMoE):
    """Router with a bias, top k logits softmaxed; experts with biases and the clamped SwiGLU. The router kernels
    compute softmax-then-top-k without a bias, so the torch router stays on every device."""

    def __init__(self, cfg: ModelConfig, moe_layer: int) -> None:
        H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        super().__init__(H, E, cfg.top_k, inter, False, moe_layer, act=cfg.hidden_act)
        self.gate = nn.Linear(H, E, bias=True)
        self.experts = Experts(E, H, inter, cfg.hidden_act, bias=True)

    def use_kernels(self, device: torch.device) -> None:
        pass  # the torch router stays (and `fuses_norm` stays False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (ids, weights) [tokens, top_k]; padding rows reuse row 0's experts."""
        ids, weights = route(self.gate(x), self.top_k, False, softmax_after_top_k=True)
        valid = get_context().valid
        if valid is not None:
            ids = torch.where(valid[:, None], ids, ids[:1])
        return ids, weights


class GptOssDecoderLayer(DecoderLayer):
    """Attention with biases and sinks, sliding or full as `layer_types` says; routed experts."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        s: GptOssSettings = cfg.family_config
        H, nq, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.self_attn = Attention(H, nq, nkv, d, rotary, cfg.qkv_bias, cfg.o_proj_bias)
        window = s.sliding_window if s.layer_types[layer] == SLIDING else None
        self.self_attn.attn = PagedAttention(nq, nkv, d, window, sinks=True)
        self.mlp = GptOssMoE(cfg, self.moe_layer)


class GptOssModel(DecoderModel):
    @staticmethod
    def make_rotary(cfg: ModelConfig) -> nn.Module:
        y: Yarn | None = cfg.family_config.yarn
        if y is None:
            return DecoderModel.make_rotary(cfg)
        return YarnRotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, y.factor, y.original_max, y.beta_fast,
            y.beta_slow, y.truncate, y.attention_factor,
        )  # fmt: skip


class GptOssForCausalLM(MoEForCausalLM):
    model_class = GptOssModel

    def __init__(self, cfg: ModelConfig, layer_class: type[DecoderLayer]) -> None:
        super().__init__(cfg, layer_class)
        self._pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # MXFP4 blocks or scales awaiting the other

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """transformers' expert tensors laid out as ours: float weights transposed ([E, in, out] -> [E, out, in]),
        gate_up rows (and biases) de-interleaved; MXFP4 `*_blocks` and `*_scales` (whichever comes second) repacked
        into MXFP4 rows."""
        if name.endswith(("_proj_blocks", "_proj_scales")):
            return self._mxfp4(name, tensor)
        if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I]
            return [(name, _deinterleave(tensor.transpose(1, 2)))]
        if name.endswith(".experts.down_proj"):  # [E, I, H]
            return [(name, tensor.transpose(1, 2))]
        if name.endswith(".experts.gate_up_proj_bias"):  # [E, 2I]
            return [(name, _deinterleave(tensor))]
        return [(name, tensor)]

    def _mxfp4(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        base, part = name.rsplit("_", 1)
        pending = self._pending.setdefault(base, {})
        pending[part] = (name, tensor)
        if len(pending) < 2:
            return []
        del self._pending[base]
        (blocks_name, blocks), (scales_name, scales) = pending["blocks"], pending["scales"]
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
            raise EdgeMoEError(
                f"tensor {blocks_name} is {blocks.dtype} {list(blocks.shape)}; MXFP4 blocks are uint8 "
                "[experts, rows, blocks, 16]"
            )
        if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
            raise EdgeMoEError(
                f"tensor {scales_name} is {scales.dtype} {list(scales.shape)}; its blocks {blocks_name} imply uint8 "
                f"{list(blocks.shape[:-1])}"
            )
        rows = mxfp4_from_packed(blocks, scales)  # [E, rows, row bytes]
        return [(base, _deinterleave(rows) if base.endswith("gate_up_proj") else rows)]


GGUF_ARCH = "gpt-oss"  # llama.cpp's name for the architecture
TOKENIZER_PRE = "gpt-2"  # random checkpoints keep the demo tokenizer's split (llama.cpp's tokenizer.ggml.pre)
TOOL_FORMAT = "harmony"  # its chat template's format (`edgemoe.tools.chat_templates`), for random checkpoints
STACKED_EXPERTS = True  # transformers' checkpoints have no per-expert layout: make-model writes them stacked
# llama.cpp's per-layer tensors whose names this architecture alone uses -> ours (the gate and up biases land in
# gate_up_proj_bias: `edgemoe.models.loader`)
GGUF_TENSORS = {
    "attn_sinks.weight": "self_attn.attn.sinks",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}


def gguf_hparams(writer, config: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The keys llama.cpp's converter writes for this architecture beyond every family's (`edgemoe.tools.make_gguf`):
    the window, the experts' width, and YaRN's as its TextModel writes them from `rope_parameters`."""
    a, rope = GGUF_ARCH, config["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        writer.add_string(f"{a}.rope.scaling.type", "yarn")
        writer.add_float32(f"{a}.rope.scaling.factor", rope["factor"])
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        for key in ("attention_factor", "beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                name = "yarn_attn_factor" if key == "attention_factor" else f"yarn_{key}"
                writer.add_float32(f"{a}.rope.scaling.{name}", rope[key])
    writer.add_uint32(f"{a}.attention.sliding_window", config["sliding_window"])
    writer.add_uint32(f"{a}.expert_feed_forward_length", config["intermediate_size"])


def gguf_tensors(name: str, t: torch.Tensor, config: dict) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the parts llama.cpp's converter writes of it (float experts), each named as the gguf
    package's name map knows it (`edgemoe.tools.make_gguf`): the experts transposed to [E, out, in], gate_up and its
    bias split into their even (gate) and odd (up) rows, the sinks as a weight."""
    stem = name.rsplit(".", 1)[0] + "."
    if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] -> gate, up [E, I, H]
        w = t.transpose(1, 2)
        return [(stem + "gate_proj.weight", w[:, 0::2]), (stem + "up_proj.weight", w[:, 1::2])]
    if name.endswith(".experts.gate_up_proj_bias"):  # [E, 2I]
        return [(stem + "gate_proj.bias", t[:, 0::2]), (stem + "up_proj.bias", t[:, 1::2])]
    if name.endswith(".experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return [(stem + "down_proj.weight", t.transpose(1, 2))]
    if name.endswith(".experts.down_proj_bias"):
        return [(stem + "down_proj.bias", t)]
    if name.endswith(".self_attn.sinks"):
        return [(name + ".weight", t)]
    return [(name, t)]


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`. It records neither the layer types nor YaRN's truncation:
    llama.cpp alternates sliding and full layers from the first, as transformers' default does, and the released
    models' YaRN is untruncated (their config's `truncate` false)."""
    a, common = GGUF_ARCH, ckpt.common_config()
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": common["rope_theta"]}
    kind = str(ckpt.field(f"{a}.rope.scaling.type", "none"))
    if kind == "yarn":
        rope |= dict(
            rope_type="yarn", factor=float(ckpt.field(f"{a}.rope.scaling.factor")), truncate=False,
            original_max_position_embeddings=int(ckpt.field(f"{a}.rope.scaling.original_context_length")),
            beta_fast=float(ckpt.field(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(ckpt.field(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
        )  # fmt: skip
        if ckpt.field(f"{a}.rope.scaling.yarn_attn_factor", None) is not None:
            rope["attention_factor"] = float(ckpt.field(f"{a}.rope.scaling.yarn_attn_factor"))
    elif kind != "none":
        raise _refuse("rope.scaling.type", kind, "yarn or none")
    fields = dict(
        num_local_experts=int(ckpt.field(f"{a}.expert_count")),
        intermediate_size=int(ckpt.field(f"{a}.expert_feed_forward_length")),
        sliding_window=int(ckpt.field(f"{a}.attention.sliding_window")),
        attention_bias=ckpt.has("blk.0.attn_q.bias"),
        rope_parameters=rope,
    )
    return common | fields | {"model_type": MODEL_TYPE}


LAYER = GptOssDecoderLayer
MODEL = GptOssForCausalLM
