"""GLM-4.5 / GLM-4.5-Air (transformers' `Glm4MoeForCausalLM`): sigmoid routing with a correction bias and group
limits, an ungated shared expert, the first `first_k_dense_replace` layers dense, partial rotary (the leading half of
each head by default), q/k/v bias, an optional per-head q/k norm. Checkpoints carry multi-token-prediction (MTP)
layers after the decoder's (`num_nextn_predict_layers`; llama.cpp's next-n blocks): for `--speculative mtp` the first
is read as the head of `edgemoe.models.mtp` (`with_mtp`; its eh_proj, enorm, hnorm and shared_head, with the copy of
the token embedding and the lm_head it carries; in a GGUF file the first next-n block), else they are skipped.

GLM-4.7-Flash is another model type (`glm4_moe_lite`, multi-head latent attention), not this family."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.context import get_context
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.attention import Attention
from edgemoe.layers.mlp import GatedMLP
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.models.decoder import DecoderLayer, MoEForCausalLM
from edgemoe.models.hf_config import common_fields
from edgemoe.models.mtp import MTPHead
from edgemoe.moe.layer import SparseMoE
from edgemoe.moe.router import route_grouped

MODEL_TYPE = "glm4_moe"
# transformers' defaults (`Glm4MoeConfig`) for the fields a config.json may leave out
_DEFAULTS = dict(rms_norm_eps=1e-5, first_k_dense_replace=1, n_shared_experts=1, norm_topk_prob=True, n_group=1,
                 topk_group=1, routed_scaling_factor=1.0, use_qk_norm=False, attention_bias=False)  # fmt: skip


@dataclass(frozen=True)
class Glm4MoeSettings:
    """What only this family reads (`ModelConfig.family_config`): a per-head RMSNorm of q and k before RoPE; the
    routing of `route_grouped` (experts chosen among the best `topk_group` of `n_group` groups, weighted by their
    sigmoid scores times `routed_scaling_factor`)."""

    qk_norm: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def normalise(hf: dict) -> ModelConfig:
    hf = {**_DEFAULTS, **hf}
    fields = common_fields(hf)
    experts, top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    n_group, topk_group = hf["n_group"], hf["topk_group"]
    check_groups(experts, top_k, n_group, topk_group)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    inter = hf["moe_intermediate_size"]
    return ModelConfig(
        **fields,
        intermediate_size=hf["intermediate_size"],
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=inter,
        moe_layers=tuple(i >= hf["first_k_dense_replace"] for i in range(fields["num_layers"])),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        shared_expert_intermediate_size=inter * hf["n_shared_experts"],
        qkv_bias=bool(hf["attention_bias"]),
        rotary_dim=int(fields["head_dim"] * partial),  # as transformers' default RoPE computes it
        family_config=Glm4MoeSettings(
            qk_norm=bool(hf["use_qk_norm"]),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
        ),
    )


def with_mtp(cfg: ModelConfig, hf: dict) -> ModelConfig:
    """`cfg` with the checkpoint's first MTP layer after the decoder's: a MoE layer (GLM-4.5's one head; more are
    not read)."""
    if not hf.get("num_nextn_predict_layers"):
        raise EdgeMoEError(
            "this checkpoint has no multi-token-prediction layer (num_nextn_predict_layers is 0): use speculative ngram"
        )
    return replace(cfg, num_layers=cfg.num_layers + 1, moe_layers=cfg.moe_layers + (True,), mtp_layers=1)


def check_groups(experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """The group limits `route_grouped` can apply, or one line naming the field that breaks them."""
    if not isinstance(n_group, int) or n_group < 1 or experts % n_group:
        raise EdgeMoEError(f"n_group {n_group!r} must be an integer >= 1 that divides n_routed_experts {experts}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise EdgeMoEError(f"topk_group {topk_group!r} must be an integer in 1..n_group {n_group}")
    if topk_group < n_group and experts // n_group < 2:
        raise EdgeMoEError(f"n_group {n_group} leaves one expert a group; a group is scored by its two best experts")
    if top_k > topk_group * (experts // n_group):
        raise EdgeMoEError(f"num_experts_per_tok {top_k} is more than the experts of topk_group {topk_group} groups")


def rename(name: str) -> str:
    """transformers' `shared_experts` (several experts' width in one MLP) is our `shared_expert`."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def checkpoint_shapes(shapes: list[tuple[str, tuple[int, ...]]], cfg: ModelConfig) -> list[tuple[str, tuple]]:
    """Our tensors (name, shape) as transformers' checkpoints spell them (`rename` undone): for random checkpoints."""
    return [(name.replace(".mlp.shared_expert.", ".mlp.shared_experts."), shape) for name, shape in shapes]


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base`, the fields every family writes,
    plus this family's from the geometry `g` (a preset of `edgemoe.tools.presets`), transformers' defaults where it
    names none."""
    own = {k: g.get(k, v) for k, v in _DEFAULTS.items()}
    rope = {"rope_type": "default", "rope_theta": base["rope_theta"]}
    fields = {
        "architectures": ["Glm4MoeForCausalLM"],
        "n_routed_experts": g["num_experts"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "intermediate_size": g["intermediate_size"],
        "head_dim": g.get("head_dim", g["hidden_size"] // g["num_attention_heads"]),
        "rope_parameters": rope | {"partial_rotary_factor": g.get("partial_rotary_factor", 0.5)},
        "num_nextn_predict_layers": 0,
    }
    return base | own | fields


GGUF_ARCH = "glm4moe"  # llama.cpp's name for the architecture; its converter writes q and k unpermuted
TOKENIZER_PRE = "gpt-2"  # random checkpoints keep the demo tokenizer's split (llama.cpp's tokenizer.ggml.pre)
TOOL_FORMAT = "glm"  # its chat template's tool calls (`edgemoe.tools.chat_templates`), for random checkpoints
# llama.cpp's per-layer tensors whose names this architecture alone uses -> Hugging Face's
GGUF_TENSORS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def gguf_hparams(writer, config: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The keys llama.cpp's converter writes for this architecture beyond every family's (`edgemoe.tools.make_gguf`:
    random checkpoints as GGUF); no next-n blocks, as random checkpoints have no MTP layer."""
    rope = config["rope_parameters"]
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_uint32(f"{GGUF_ARCH}.expert_gating_func", _SIGMOID)  # the value of gguf's ExpertGatingFuncType.SIGMOID
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`: the rotary dims as llama.cpp's rope dimension count, q/k
    bias and norm where the file has their tensors, top-k renormalisation where it says so (llama.cpp's default:
    off)."""
    a, common = GGUF_ARCH, ckpt.common_config()
    gating = int(ckpt.field(f"{a}.expert_gating_func", _SIGMOID))
    if gating != _SIGMOID:
        raise EdgeMoEError(f"{ckpt.path.name}: expert_gating_func {gating}; glm4moe routes by sigmoid ({_SIGMOID})")
    rotary = int(ckpt.field(f"{a}.rope.dimension_count", common["head_dim"]))
    fields = dict(
        n_routed_experts=int(ckpt.field(f"{a}.expert_count")),
        moe_intermediate_size=int(ckpt.field(f"{a}.expert_feed_forward_length")),
        intermediate_size=int(ckpt.field(f"{a}.feed_forward_length")),
        n_shared_experts=int(ckpt.field(f"{a}.expert_shared_count", 0)),
        first_k_dense_replace=int(ckpt.field(f"{a}.leading_dense_block_count", 0)),
        norm_topk_prob=bool(ckpt.field(f"{a}.expert_weights_norm", False)),
        routed_scaling_factor=float(ckpt.field(f"{a}.expert_weights_scale", 1.0)),
        n_group=int(ckpt.field(f"{a}.expert_group_count", 1)),
        topk_group=int(ckpt.field(f"{a}.expert_group_used_count", 1)),
        partial_rotary_factor=rotary / common["head_dim"],
        attention_bias=ckpt.has("blk.0.attn_q.bias"),
        use_qk_norm=ckpt.has("blk.0.attn_q_norm.weight"),
        num_nextn_predict_layers=int(ckpt.field(f"{a}.nextn_predict_layers", 0)),
    )
    return common | fields | {"model_type": MODEL_TYPE}


class Glm4MoeMoE(SparseMoE):
    """Routed experts chosen by `route_grouped` (sigmoid scores, correction bias, group limits, scaling factor) plus
    a shared expert whose output is added as it is (no gate). The router runs in float32, its weight and bias kept so
    by the loader (`float32_parameters`), as transformers keeps them: the bias decides between scores closer than
    bfloat16 tells apart. On CUDA decode routes by `grouped_route` (two Triton launches); prefill and the CPU by
    `route_grouped`."""

    float32_parameters = ("gate.weight", "gate.e_score_correction_bias")

    def __init__(self, cfg: ModelConfig, moe_layer: int) -> None:
        H, E = cfg.hidden_size, cfg.num_experts
        super().__init__(H, E, cfg.top_k, cfg.moe_intermediate_size, cfg.norm_topk_prob, moe_layer)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E))  # transformers' name, beside gate.weight
        own = cfg.family_config
        self.n_group, self.topk_group, self.scale = own.n_group, own.topk_group, own.routed_scaling_factor
        self._grouped_route = None  # `edgemoe.kernels.router.grouped_route`, once `use_kernels` chose it
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(H, cfg.shared_expert_intermediate_size)

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.router import MAX_EXPERTS, grouped_route

        n = self.n_group
        if n <= 32 and not n & (n - 1) and self.gate.weight.shape[0] <= MAX_EXPERTS:  # what the kernel holds
            self._grouped_route = grouped_route  # decode: 2 launches instead of ~12 (`fuses_norm` stays False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (ids, weights in x's dtype) [tokens, top_k]; padding rows reuse row 0's experts."""
        ctx = get_context()
        bias, groups = self.gate.e_score_correction_bias, (self.n_group, self.topk_group)
        if self._grouped_route is not None and not ctx.is_prefill:
            return self._grouped_route(
                x, self.gate.weight, bias, self.top_k, *groups, self.norm_topk_prob, self.scale, ctx.valid
            )
        logits = F.linear(x.float(), self.gate.weight.float())  # [tokens, experts]
        ids, weights = route_grouped(logits, bias, self.top_k, *groups, self.norm_topk_prob, self.scale)
        if ctx.valid is not None:
            ids = torch.where(ctx.valid[:, None], ids, ids[:1])
        return ids, weights.to(x.dtype)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)


class Glm4MoeDecoderLayer(DecoderLayer):
    """Attention with q/k/v bias (where the config says), optionally a per-head q/k norm, partial rotary; routed plus
    shared experts, or a dense MLP in the first layers."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        norm = cfg.rms_norm_eps if cfg.family_config.qk_norm else None
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, cfg.qkv_bias, head_norm_eps=norm
        )
        self.mlp = Glm4MoeMoE(cfg, self.moe_layer) if self.is_moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size)


LAYER = Glm4MoeDecoderLayer
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class Glm4MoeMTPHead(MTPHead):
    """GLM-4.5's head reads the token embedding and the lm_head its layer carries, and zeroes position 0's
    embedding, as vLLM's GLM-4.5 head does."""

    own_vocab = True
    mask_first = True


# the MTP layer's own tensors (after `model.layers.N.`) -> the head's parameters
_MTP_NAMES = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
              "hnorm.weight": "pre_fc_norm_hidden.weight", "shared_head.norm.weight": "norm.weight",
              "shared_head.head.weight": "head.weight", "embed_tokens.weight": "embed_tokens.weight"}  # fmt: skip


class Glm4MoeForCausalLM(MoEForCausalLM):
    """The checkpoint's MTP layers, numbered after the decoder's, are skipped but where the config has the head's
    layer (`with_mtp`): its own tensors then go to the head (`_MTP_NAMES`), the rest to its decoder layer. So are the
    zero-width shared-expert tensors of a checkpoint with `n_shared_experts` 0."""

    mtp_class = Glm4MoeMTPHead

    def checkpoint_name(self, name: str) -> str | None:
        m = _LAYER_NAME.match(name)
        if m and int(m[1]) >= self.config.num_layers:
            return None
        if ".shared_expert." in name and not self.config.shared_expert_intermediate_size:
            return None
        if m and self.config.mtp_layers and int(m[1]) == self.config.decoder_layers:
            own = _MTP_NAMES.get(name[m.end() :])
            return name if own is None else f"mtp.{own}"
        return name


MODEL = Glm4MoeForCausalLM
