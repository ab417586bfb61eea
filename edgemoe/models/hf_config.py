"""Reading a Hugging Face `config.json`: the fields every family reads the same way (each family's `normalise`
adds its own)."""

from __future__ import annotations

from typing import Any

from edgemoe.errors import EdgeMoEError


def common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Fields every family reads the same way."""
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise EdgeMoEError(f"rope type {rope_type!r} is not supported yet (only the default RoPE)")
    eos = hf.get("eos_token_id")
    return dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        bos_token_id=hf.get("bos_token_id"),
    )


def sparse_layers(hf: dict[str, Any], num_experts: int) -> tuple[bool, ...]:
    """Qwen-style placement: MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"]))


def gguf_sparse_fields(ckpt: Any, renormalise: bool) -> dict[str, Any]:
    """The Qwen-MoE families' GGUF metadata as `config.json` fields: experts and their width, the dense layers (those
    without expert tensors), q/k/v bias where the file has it, and the top-k renormalisation llama.cpp applies (the
    file does not record it: Qwen3-MoE renormalises, Qwen2-MoE does not). `ckpt`: a `GGUFCheckpoint`."""
    a, layers = ckpt.arch, ckpt.layers
    bias = ckpt.has("blk.0.attn_q.bias")
    return dict(
        num_experts=int(ckpt.field(f"{a}.expert_count")), decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if not ckpt.has(f"blk.{i}.ffn_gate_exps.weight")],
        intermediate_size=int(ckpt.field(f"{a}.feed_forward_length", 0)),
        moe_intermediate_size=int(ckpt.field(f"{a}.expert_feed_forward_length")),
        attention_bias=bias, qkv_bias=bias, norm_topk_prob=renormalise,
    )  # fmt: skip
