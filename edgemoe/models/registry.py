"""Model families by Hugging Face `model_type`, and reading a checkpoint's `config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError


def families() -> dict[str, ModuleType]:
    from edgemoe.models import mixtral, olmoe, qwen2_moe, qwen3_moe

    return {m.MODEL_TYPE: m for m in (qwen2_moe, qwen3_moe, mixtral, olmoe)}


def read_config(folder: Path) -> tuple[ModelConfig, ModuleType]:
    path = folder / "config.json"
    if not path.is_file():
        raise EdgeMoEError(f"{folder} is not a model folder: no config.json")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EdgeMoEError(f"malformed {path}: {exc}") from None
    if not isinstance(hf, dict):
        raise EdgeMoEError(f"malformed {path}: expected a JSON object")
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            hf = {**hf, **{k: v for k, v in json.loads(gen.read_text()).items() if k.endswith("token_id")}}
        except json.JSONDecodeError as exc:
            raise EdgeMoEError(f"malformed {gen}: {exc}") from None
    family = families().get(hf.get("model_type"))
    if family is None:
        raise EdgeMoEError(
            f"unsupported model_type {hf.get('model_type')!r} in {path}; supported: {', '.join(sorted(families()))}"
        )
    try:
        return family.normalise(hf), family
    except (KeyError, TypeError, ValueError) as exc:
        raise EdgeMoEError(f"malformed {path}: bad or missing field {exc}") from None


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
