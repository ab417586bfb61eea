"""Qwen3-Next and Qwen3.5 / Qwen3.6 MoE: hybrid layers, three Gated DeltaNet (linear attention, a fixed state per
sequence: `edgemoe.layers.linear_attention`) to one gated full-attention layer (`layer_types`), and in every layer
routed experts plus a sigmoid-gated shared expert.

The full-attention layers gate their output per channel (q_proj writes each head's q and its gate side by side),
normalise q and k per head and rotate only the first quarter of each head's dims (`rotary_dim`). Every RMSNorm
but the linear attention's output norm scales by (1 + weight): the loader adds the 1 once (`convert`), as llama.cpp's
converter does, so the norms are the other families' (and their kernels).

Checkpoints: Qwen3-Next (`Qwen3NextForCausalLM`) interleaves each key head's q, k, v and z rows in one
`in_proj_qkvz` (split here into Qwen3.5's in_proj_qkv and in_proj_z, as llama.cpp's converter does) and its b and a
rows in `in_proj_ba` (kept: one projection); Qwen3.5 writes four projections. Qwen3.5 ships as
`Qwen3_5MoeForConditionalGeneration` (its language model under `model.language_model`, a vision tower under
`model.visual`, skipped) or as `Qwen3_5MoeForCausalLM` (`qwen3_5_moe_text`). The multi-token-prediction head the
checkpoints carry (`mtp.*`: `edgemoe.models.mtp`; in GGUF files llama.cpp's next-n block after the decoder's, its norms
with their 1 added as the others') is read for `--speculative mtp` (`with_mtp`), else skipped; its layer is a gated
full-attention layer with routed and shared experts.

GGUF files (llama.cpp's `qwen3next` and `qwen35moe`) hold the norms with their 1 added, A as -exp(A_log), the
projections split, and for `qwen35moe` the value heads in tiled order (`edgemoe.layers.linear_attention`): read as
stored, no conversion. `edgemoe make-model --format gguf` writes them so (`gguf_hparams`, `gguf_tensors`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.linear_attention import GatedDeltaNet
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, MoEForCausalLM, moe_or_mlp
from edgemoe.models.hf_config import common_fields, gguf_sparse_fields, sparse_layers

MODEL_TYPE = "qwen3_next"
MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


# tensor parallelism (`edgemoe.engine.parallel.Cut`): the linear attention's tensors laid out by value head, its
# out_proj's columns likewise; in_proj_qkv's rows and its convolution's channels in three runs (q, k and v heads)
SPLIT_WITH_HEADS = (".self_attn.in_proj_z.weight", ".self_attn.in_proj_b.weight", ".self_attn.in_proj_a.weight",
                    ".self_attn.in_proj_ba.weight", ".self_attn.dt_bias", ".self_attn.A")  # fmt: skip
SPLIT_COLUMNS_WITH_HEADS = (".self_attn.out_proj.weight",)


def split_segments(cfg: ModelConfig) -> dict[str, list[int]]:
    """The runs of in_proj_qkv's rows and of its convolution's channels that each split alike (`Cut.segments`)."""
    s: HybridSettings = cfg.family_config
    runs = [s.k_heads * s.k_dim, s.k_heads * s.k_dim, s.v_heads * s.v_dim]
    return {".self_attn.in_proj_qkv.weight": runs, ".self_attn.conv1d.weight": runs}


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """A tensor-parallel rank's linear attention heads (`edgemoe.engine.parallel`): a contiguous run of q/k heads
    with their value heads (grouped after them, as Hugging Face checkpoints order them). A GGUF file's tiled order,
    heads that do not split evenly: one line."""
    s: HybridSettings = cfg.family_config
    if s.tiled:
        raise EdgeMoEError(f"tensor_parallel {world}: a qwen35moe GGUF file's tiled value heads are not split yet")
    if s.k_heads % world:
        raise EdgeMoEError(f"tensor_parallel {world}: linear_num_key_heads {s.k_heads} does not split into {world} "
                           "equal parts")  # fmt: skip
    return replace(cfg, family_config=replace(s, k_heads=s.k_heads // world, v_heads=s.v_heads // world))


@dataclass(frozen=True)
class HybridSettings:
    layer_types: tuple[str, ...]  # per layer, one of LAYER_TYPES
    k_heads: int  # the linear attention's q/k heads
    v_heads: int  # its value heads (a multiple of k_heads)
    k_dim: int
    v_dim: int
    conv_kernel: int  # its causal convolution's width
    interleaved: bool  # Qwen3-Next's layout: in_proj_qkvz (Hugging Face checkpoints), in_proj_ba (else b and a apart)
    tiled: bool  # the value heads in llama.cpp's tiled order (a `qwen35moe` GGUF file)


def text_config(hf: dict) -> dict:
    """A Qwen3.5 MoE `config.json` keeps the language model's fields under `text_config` (the token ids may be at
    the top): one flat dict, `model_type` the outer one's."""
    inner = hf.get("text_config")
    if not isinstance(inner, dict):
        return hf
    top = {k: v for k, v in hf.items() if k.endswith("token_id") and v is not None}
    return {**inner, **top, "model_type": hf["model_type"]}


def normalise(hf: dict) -> ModelConfig:
    hf = text_config(hf)
    layers, experts = hf["num_hidden_layers"], hf["num_experts"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(layers)
    ]
    if len(types) != layers:
        raise EdgeMoEError(f"layer_types has {len(types)} entries for {layers} layers (num_hidden_layers)")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise EdgeMoEError(f"layer_types[{i}] is {t!r}; this family has {' and '.join(LAYER_TYPES)} layers")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    common = common_fields(hf)
    bias = bool(hf.get("attention_bias", False))
    settings = HybridSettings(
        layer_types=tuple(types),
        k_heads=hf["linear_num_key_heads"],
        v_heads=hf["linear_num_value_heads"],
        k_dim=hf["linear_key_head_dim"],
        v_dim=hf["linear_value_head_dim"],
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        interleaved=hf["model_type"] == "qwen3_next",
        tiled=bool(hf.get("value_heads_tiled", False)),
    )
    if settings.v_heads % settings.k_heads:
        raise EdgeMoEError(
            f"linear_num_value_heads {settings.v_heads} is not a multiple of linear_num_key_heads {settings.k_heads}"
        )
    return ModelConfig(
        **common,
        rotary_dim=int(common["head_dim"] * partial),
        intermediate_size=hf.get("intermediate_size", 0),
        num_experts=experts,
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        moe_layers=sparse_layers(hf, experts),
        # Qwen3.5's router always renormalises its top k
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) or hf["model_type"] != "qwen3_next",
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
        qkv_bias=bias,
        o_proj_bias=bias,
        no_kv_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        family_config=settings,
    )


def with_mtp(cfg: ModelConfig, hf: dict) -> ModelConfig:
    """`cfg` with the checkpoint's multi-token-prediction layers after the decoder's (`mtp_num_hidden_layers`): each a
    gated full-attention layer with routed experts and the shared expert."""
    n = text_config(hf).get("mtp_num_hidden_layers") or 0
    if not n:
        raise EdgeMoEError(
            "this checkpoint has no multi-token-prediction head (no mtp_num_hidden_layers, or in a GGUF file no "
            "next-n block): use speculative ngram"
        )
    s: HybridSettings = cfg.family_config
    return replace(
        cfg,
        num_layers=cfg.num_layers + n,
        moe_layers=cfg.moe_layers + (cfg.num_experts > 0,) * n,
        mtp_layers=n,
        family_config=replace(s, layer_types=s.layer_types + ("full_attention",) * n),
    )


# llama.cpp's architecture of each model type (Qwen3-Next's, Qwen3.5 / 3.6 MoE's), and the model type its files read as
GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe"}
_GGUF_MODEL_TYPES = {"qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text"}
GGUF_ARCHS = tuple(_GGUF_MODEL_TYPES)
# random checkpoints (by model type): the demo tokenizer's Qwen2 split; Qwen3-Next's JSON tool calls, Qwen3.5's XML
TOKENIZER_PRE = "qwen2"
TOOL_FORMAT = {"qwen3_next": "qwen", "qwen3_5_moe": "qwen3_coder", "qwen3_5_moe_text": "qwen3_coder"}
# llama.cpp's per-layer tensors whose names only the hybrid architectures use -> ours
GGUF_TENSORS = {
    "attn_qkv.weight": "self_attn.in_proj_qkv.weight",
    "attn_gate.weight": "self_attn.in_proj_z.weight",
    "ssm_ba.weight": "self_attn.in_proj_ba.weight",
    "ssm_beta.weight": "self_attn.in_proj_b.weight",
    "ssm_alpha.weight": "self_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "self_attn.conv1d.weight",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_a": "self_attn.A",
    "ssm_norm.weight": "self_attn.norm.weight",
    "ssm_out.weight": "self_attn.out_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`: the linear attention's shapes from llama.cpp's ssm keys
    (state_size: the q/k head dim, group_count: the q/k heads, time_step_rank: the value heads, inner_size: all value
    dims), the layer types from `attention.recurrent_layers` (the decoder's entries; the next-n blocks follow), the
    rotary dims from `rope.dimension_count`. llama.cpp renormalises both architectures' top-k weights."""
    a, common = ckpt.arch, ckpt.common_config()
    layers, v_heads = common["num_hidden_layers"], int(ckpt.field(f"{a}.ssm.time_step_rank"))
    recurrent = ckpt.field(f"{a}.attention.recurrent_layers", None)
    if recurrent is None:
        interval = int(ckpt.field(f"{a}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    first_full = next((i for i, r in enumerate(recurrent[:layers]) if not r), 0)
    k_heads = int(ckpt.field(f"{a}.ssm.group_count"))
    fields = dict(
        shared_expert_intermediate_size=int(ckpt.field(f"{a}.expert_shared_feed_forward_length", 0)),
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        linear_conv_kernel_dim=int(ckpt.field(f"{a}.ssm.conv_kernel")),
        linear_key_head_dim=int(ckpt.field(f"{a}.ssm.state_size")),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_value_head_dim=int(ckpt.field(f"{a}.ssm.inner_size")) // v_heads,
        partial_rotary_factor=int(ckpt.field(f"{a}.rope.dimension_count", common["head_dim"])) / common["head_dim"],
        attention_bias=ckpt.has(f"blk.{first_full}.attn_q.bias"),
        value_heads_tiled=a == "qwen35moe" and v_heads != k_heads,
        mtp_num_hidden_layers=min(1, int(ckpt.field(f"{a}.nextn_predict_layers", 0))),  # the first next-n block
    )
    sparse = gguf_sparse_fields(ckpt, renormalise=True)
    return common | sparse | fields | {"model_type": _GGUF_MODEL_TYPES[a]}


def gguf_hparams(writer, config: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The keys llama.cpp's converter writes for these architectures beyond every family's (`edgemoe.tools.make_gguf`:
    random checkpoints as GGUF): the experts' widths, the linear attention's shapes as the ssm keys `gguf_config`
    reads, which layers are recurrent, the rotary dims, and for Qwen3.5 the M-RoPE sections it writes when the
    checkpoint names none. The converter reads config.json through transformers, which keeps layer_types but not
    full_attention_interval: it writes its default interval, 4, whatever the checkpoint's (llama.cpp, like
    `gguf_config`, takes the recurrent layers first). No next-n keys: random checkpoints have no MTP head."""
    cfg = normalise(config)
    s: HybridSettings = cfg.family_config
    arch = GGUF_ARCH[config["model_type"]]
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(s.conv_kernel)
    writer.add_ssm_state_size(s.k_dim)
    writer.add_ssm_group_count(s.k_heads)
    writer.add_ssm_time_step_rank(s.v_heads)
    writer.add_ssm_inner_size(s.v_heads * s.v_dim)
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in s.layer_types])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "qwen35moe":
        writer.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default, Qwen3.5's M-RoPE sections


def gguf_tensors(name: str, t: torch.Tensor, config: dict) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as llama.cpp's converter writes it (`edgemoe.tools.make_gguf`), computed in its dtype as the
    converter computes: the (1 + weight) norms with the 1 added, A_log as A = -exp(A_log), dt_bias as the dt
    projection's bias, the convolution [channels, kernel], Qwen3-Next's in_proj_qkvz split (`split_qkvz`), and in a
    qwen35moe file every value-head tensor in tiled order (`tile_value_heads`)."""
    if ".linear_attn." not in name:
        return [(name, t + 1 if name.endswith("norm.weight") else t)]
    s: HybridSettings = normalise(config).family_config
    if GGUF_ARCH[config["model_type"]] == "qwen35moe" and s.v_heads != s.k_heads:
        t = tile_value_heads(name, t, s)
    prefix, part = name.split(".linear_attn.")
    prefix += ".linear_attn."
    if part == "A_log":
        return [(name, -t.exp())]
    if part == "dt_bias":
        return [(prefix + "dt_proj.bias", t)]
    if part == "conv1d.weight":
        return [(name, t.squeeze(1))]
    if part == "in_proj_qkvz.weight":
        qkv, z = split_qkvz(t, s)
        return [(prefix + "in_proj_qkv.weight", qkv), (prefix + "in_proj_z.weight", z)]
    return [(name, t)]


def tile_value_heads(name: str, t: torch.Tensor, s: HybridSettings) -> torch.Tensor:
    """A Qwen3.5 linear-attention tensor with its value heads from grouped order (each q/k head's consecutive
    ones) to tiled (value head h reads q/k head h % k_heads): the rows of v (in in_proj_qkv and the convolution, after
    the q and k rows), z, b, a, A_log and dt_bias, out_proj's columns."""
    part = name.split(".linear_attn.")[1]
    r, qk_rows = s.v_heads // s.k_heads, 2 * s.k_heads * s.k_dim

    def tiled(x: torch.Tensor, dim: int, d: int) -> torch.Tensor:  # [.., k_heads, r, d, ..] -> [.., r, k_heads, d, ..]
        shape = x.shape
        return x.unflatten(dim, (s.k_heads, r, d)).transpose(dim, dim + 1).reshape(shape)

    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        return torch.cat((t[:qk_rows], tiled(t[qk_rows:], 0, s.v_dim)))
    if part == "in_proj_z.weight":
        return tiled(t, 0, s.v_dim)
    if part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return tiled(t, 0, 1)
    if part == "out_proj.weight":
        return tiled(t, 1, s.v_dim)
    return t


def split_qkvz(w: torch.Tensor, s: HybridSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz (per key head: its q, k, value heads' v, then their z rows) -> in_proj_qkv (every q,
    then every k, then every v row) and in_proj_z, as llama.cpp's converter splits it. The key heads are counted
    from the rows (a tensor-parallel rank's `s` has its share of them; the checkpoint's tensor has all)."""
    hidden, r = w.shape[-1], s.v_heads // s.k_heads
    sizes = [s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim]
    parts = w.reshape(w.shape[0] // sum(sizes), -1, hidden).split(sizes, 1)
    q, k, v, z = (p.reshape(-1, hidden) for p in parts)
    return torch.cat((q, k, v)), z


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base`, the fields every family writes,
    plus this family's from the geometry `g` (a preset of `edgemoe.tools.presets`); the linear attention's shapes
    where a preset names none (the small ones): half as many q/k heads as value heads, as the released models have,
    each as wide as an attention head."""
    head_dim = g.get("head_dim", g["hidden_size"] // g["num_attention_heads"])
    heads = g["num_attention_heads"]
    linear = dict(linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                  linear_value_head_dim=head_dim)  # fmt: skip
    architecture = "Qwen3NextForCausalLM" if base["model_type"] == "qwen3_next" else "Qwen3_5MoeForCausalLM"
    return (
        base
        | {k: g.get(k, v) for k, v in linear.items()}
        | {
            "architectures": [architecture],
            "num_experts": g["num_experts"],
            "moe_intermediate_size": g["moe_intermediate_size"],
            "shared_expert_intermediate_size": g["shared_expert_intermediate_size"],
            "intermediate_size": g.get("intermediate_size", g["moe_intermediate_size"]),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "full_attention_interval": min(4, g["num_hidden_layers"]),  # a small preset keeps one full layer
            "linear_conv_kernel_dim": 4,
            "partial_rotary_factor": 0.25,
            "attention_bias": False,
            "head_dim": head_dim,
        }
    )


def checkpoint_shapes(shapes: list[tuple[str, tuple[int, ...]]], cfg: ModelConfig) -> list[tuple[str, tuple]]:
    """Our tensors (name, shape) as a Hugging Face checkpoint of the family names them (random checkpoints,
    `edgemoe.tools.random_weights`): linear-attention layers under `linear_attn`, A as A_log, and for Qwen3-Next
    in_proj_qkv and in_proj_z as one in_proj_qkvz (the rows' order does not matter to random weights)."""
    s: HybridSettings = cfg.family_config
    out = []
    for name, shape in shapes:
        m = re.match(r"model\.layers\.(\d+)\.self_attn\.(.+)$", name)
        if not m or s.layer_types[int(m[1])] != "linear_attention":
            out.append((name, shape))
            continue
        prefix, part = f"model.layers.{m[1]}.linear_attn", m[2]
        if part == "A":
            out.append((f"{prefix}.A_log", shape))
        elif s.interleaved and part == "in_proj_qkv.weight":
            z_rows = s.v_heads * s.v_dim
            out.append((f"{prefix}.in_proj_qkvz.weight", (shape[0] + z_rows, shape[1])))
        elif not (s.interleaved and part == "in_proj_z.weight"):
            out.append((f"{prefix}.{part}", shape))
    return out


def rename(name: str) -> str:
    """Checkpoint names -> ours: the language model of a Qwen3.5 checkpoint under `model.`, a linear-attention layer's
    mixer under `self_attn` like a full-attention layer's (`DecoderLayer` runs either)."""
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    return name.replace(".linear_attn.", ".self_attn.")


class GatedAttention(Attention):
    """Attention whose output is gated per channel by sigmoid(gate), the gate projected with q: q_proj's rows are
    each head's q then its gate (`qkv_proj` holds them as q_proj does), then k and v."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        super().__init__(cfg.hidden_size, nq, nkv, d, rotary, cfg.qkv_bias, cfg.o_proj_bias, cfg.rms_norm_eps)
        self.qkv_sizes = [2 * nq * d, nkv * d, nkv * d]
        self.qkv_proj = DecodeLinear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.qkv_bias)

    def forward(self, x: torch.Tensor | None, positions: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x) if qkv is None else qkv
        q_gate, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q_gate = q_gate.view(-1, self.nq, 2 * self.d)
        q, gate = q_gate[..., : self.d], q_gate[..., self.d :]
        k, v = k.view(-1, self.nkv, self.d), v.view(-1, self.nkv, self.d)
        out = self.attn.attend(self._prologue(q, k, v, positions))  # [tokens, heads * head_dim]
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class HybridDecoderLayer(DecoderLayer):
    """A Gated DeltaNet or a gated full-attention layer, as `layer_types` says; routed experts plus a sigmoid-gated
    shared expert, or a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        s: HybridSettings = cfg.family_config
        if s.layer_types[layer] == "linear_attention":
            self.self_attn = GatedDeltaNet(
                cfg.hidden_size, s.k_heads, s.v_heads, s.k_dim, s.v_dim, s.conv_kernel, cfg.rms_norm_eps,
                fused_ba=s.interleaved, tiled=s.tiled,
            )  # fmt: skip
        else:
            self.self_attn = GatedAttention(cfg, rotary)
        self.mlp = moe_or_mlp(cfg, self, shared=cfg.shared_expert_intermediate_size)


LAYER = HybridDecoderLayer


class HybridForCausalLM(MoEForCausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        """A vision tower is not used; the multi-token-prediction head only where the config has its layers
        (`mtp.layers.j` -> the decoder's layer list after its own)."""
        if name.startswith("model.visual."):
            return None
        if not name.startswith(("mtp.", "model.mtp.")):
            return name
        if not self.config.mtp_layers:
            return None
        name = name.removeprefix("model.")
        m = re.match(r"mtp\.layers\.(\d+)\.(.+)$", name)
        return name if m is None else f"model.layers.{self.config.decoder_layers + int(m[1])}.{m[2]}"

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A Hugging Face checkpoint's tensor as llama.cpp's converter writes it: (1 + weight) norms as plain ones,
        A_log as A = -exp(A_log) (in fp32, as transformers computes it), Qwen3-Next's in_proj_qkvz as in_proj_qkv
        and in_proj_z."""
        norms = ("norm.weight", "norm_embedding.weight", "norm_hidden.weight")  # the MTP head's pre_fc_norm_* too
        if name.endswith(norms) and isinstance(self.get_submodule(name.removesuffix(".weight")), RMSNorm):
            return [(name, tensor.float() + 1)]
        if name.endswith(".A_log"):
            return [(name.removesuffix("_log"), -tensor.float().exp())]
        if not name.endswith(".in_proj_qkvz.weight"):
            return [(name, tensor)]
        prefix = name.rsplit(".", 2)[0]
        qkv, z = split_qkvz(tensor, self.config.family_config)
        return [(f"{prefix}.in_proj_qkv.weight", qkv), (f"{prefix}.in_proj_z.weight", z)]


MODEL = HybridForCausalLM
