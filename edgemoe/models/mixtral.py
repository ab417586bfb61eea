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


_EXPERT_PARTS = {".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight", ".w2.weight": ".down_proj.weight"}


def rename(name: str) -> str:
    """`block_sparse_moe` -> `mlp`; an expert's w1 / w3 / w2 -> gate_proj / up_proj / down_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if ".experts." in name:
        for old, new in _EXPERT_PARTS.items():
            if name.endswith(old):
                return name.removesuffix(old) + new
    return name


GGUF_ARCH = "llama"  # llama.cpp writes Mixtral as the llama architecture with experts
GGUF_PERMUTED_QK = True  # and q/k rows permuted for its RoPE (`models.gguf.unpermute`)
TOKENIZER_PRE = "gpt-2"  # how its tokenizer splits text (llama.cpp's tokenizer.ggml.pre), for random checkpoints
TOOL_FORMAT = "mistral"  # its chat template's tool calls (`edgemoe.tools.chat_templates`), for random checkpoints
# its checkpoints' per-expert names: block_sparse_moe.experts.N.{w1 (gate), w3 (up), w2 (down)}
CHECKPOINT_EXPERTS = ("block_sparse_moe", "w1", "w3", "w2")


def random_config(base: dict, g: dict) -> dict:
    """A random checkpoint's config.json (`edgemoe.tools.random_weights`): `base` plus this family's fields from the
    geometry `g` (a preset of `edgemoe.tools.presets`)."""
    return base | {
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": g["num_experts"],
        "intermediate_size": g["moe_intermediate_size"],
        "sliding_window": None,
    }


def gguf_hparams(writer, config: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """The keys llama.cpp's converter writes for the llama architecture beyond every family's
    (`edgemoe.tools.make_gguf`)."""
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def gguf_config(ckpt) -> dict:  # noqa: ANN001 - a models.gguf.GGUFCheckpoint
    """The file's metadata as this family's `config.json`: every layer sparse, the experts' width as
    feed_forward_length. A llama file without experts is a dense llama: refused."""
    experts = int(ckpt.field("llama.expert_count", 0))
    if not experts:
        raise EdgeMoEError(f"{ckpt.path.name}: a llama model without experts is not a MoE model edgemoe runs")
    fields = dict(num_local_experts=experts, intermediate_size=int(ckpt.field("llama.feed_forward_length")))
    return ckpt.common_config() | fields | {"model_type": MODEL_TYPE}


class MixtralDecoderLayer(DecoderLayer):
    """Plain attention; routed experts in every layer."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, layer)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary)
        self.mlp = moe_or_mlp(cfg, self)


LAYER = MixtralDecoderLayer
