"""Model families by Hugging Face `model_type` (a plain table), and reading a checkpoint's `config.json`.

A family is a module with `MODEL_TYPE`, `normalise(hf) -> ModelConfig`, `rename(checkpoint name) -> our name` and
`LAYER`, its `DecoderLayer` class; optionally `MODEL_TYPES` (every `model_type` it reads), `MODEL`, its
`MoEForCausalLM` subclass (another embedding, layer loop or logits, config-dependent checkpoint names), and for GGUF
files `GGUF_ARCH` (llama.cpp's architecture name; by model type where a family reads several, which `GGUF_ARCHS`
lists), `gguf_config(ckpt) -> config.json fields`, `GGUF_PERMUTED_QK` (q/k rows in llama.cpp's RoPE order) and
`GGUF_TENSORS` (llama.cpp's per-layer tensor names that only this architecture uses -> Hugging Face's, e.g.
`exp_probs_b.bias`); `gguf_hparams` and `gguf_tensors` say what llama.cpp's converter writes of its own
(`edgemoe.tools.make_gguf`); `with_mtp(config, hf) -> ModelConfig` where its checkpoints carry a multi-token-prediction
head (`edgemoe.models.mtp`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.models import gemma4, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe, qwen3_next
from edgemoe.models.gguf import GGUFCheckpoint

FAMILIES: dict[str, ModuleType] = {
    t: m
    for m in (qwen2_moe, qwen3_moe, mixtral, olmoe, gemma4, qwen3_next, glm4_moe, gpt_oss)
    for t in getattr(m, "MODEL_TYPES", (m.MODEL_TYPE,))
}
# llama.cpp's architecture name -> the family that reads such GGUF files (its `GGUF_ARCH`, `gguf_config`)
# (`GGUF_ARCHS` where a family reads several: Qwen3-Next's and Qwen3.5's)
GGUF_FAMILIES: dict[str, ModuleType] = {
    a: m
    for m in set(FAMILIES.values())
    for a in getattr(m, "GGUF_ARCHS", [m.GGUF_ARCH] if hasattr(m, "GGUF_ARCH") else [])
}


def read_config(folder: Path, mtp: bool = False) -> tuple[ModelConfig, ModuleType]:
    """`mtp`: the config with the checkpoint's multi-token-prediction layers (`--speculative mtp`)."""
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
            extra = json.loads(gen.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EdgeMoEError(f"malformed {gen}: {exc}") from None
        if not isinstance(extra, dict):
            raise EdgeMoEError(f"malformed {gen}: expected a JSON object")
        hf = {**hf, **{k: v for k, v in extra.items() if k.endswith("token_id")}}
    family = FAMILIES.get(hf.get("model_type"))
    if family is None:
        raise EdgeMoEError(
            f"unsupported model_type {hf.get('model_type')!r} in {path}; supported: {', '.join(sorted(FAMILIES))}"
        )
    try:
        cfg = family.normalise(hf)
        return (with_mtp(cfg, family, hf) if mtp else cfg), family
    except EdgeMoEError as exc:  # the family refuses what it does not support: not malformed
        raise EdgeMoEError(f"{path}: {exc}") from None
    except KeyError as exc:
        raise EdgeMoEError(f"malformed {path}: missing field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise EdgeMoEError(f"malformed {path}: {exc}") from None


def with_mtp(cfg: ModelConfig, family: ModuleType, hf: dict) -> ModelConfig:
    """`cfg` with the multi-token-prediction layers of the checkpoint whose `config.json` (fields) is `hf`."""
    hook = getattr(family, "with_mtp", None)
    if hook is None:
        raise EdgeMoEError(
            f"{cfg.model_type} checkpoints carry no multi-token-prediction head that edgemoe reads (speculative mtp: "
            "Qwen3-Next, Qwen3.5/3.6 MoE, GLM-4.5); use speculative ngram"
        )
    return hook(cfg, hf)


def family_value(model_type: str, name: str, default: object = None) -> object:
    """A family module's attribute `name` for `model_type` (a module reading several model types may key it by
    type), or `default`."""
    value = getattr(FAMILIES[model_type], name, default)
    return value[model_type] if isinstance(value, dict) else value


def read_checkpoint(path: Path, mtp: bool = False) -> tuple[ModelConfig, ModuleType, GGUFCheckpoint | None]:
    """A model folder (`config.json`, safetensors) or a GGUF file (one, or any part of a split set) ->
    (config, family, the opened GGUF checkpoint or None). `mtp`: with the multi-token-prediction layers."""
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EdgeMoEError(f"model file {path} does not exist")
        ckpt = GGUFCheckpoint(path)
        family = GGUF_FAMILIES.get(ckpt.arch)
        if family is None:
            supported = ", ".join(sorted(GGUF_FAMILIES))
            raise EdgeMoEError(f"{path.name}: architecture {ckpt.arch!r} is not supported; supported: {supported}")
        ckpt.permuted_qk = getattr(family, "GGUF_PERMUTED_QK", False)
        ckpt.layer_tensors = getattr(family, "GGUF_TENSORS", {})
        try:
            hf = family.gguf_config(ckpt)
            cfg = family.normalise(hf)
            if mtp:
                cfg = with_mtp(cfg, family, hf)
                ckpt.mtp_blocks = cfg.mtp_layers
            return cfg, family, ckpt
        except EdgeMoEError as exc:  # the family refuses what it does not support, named by the file
            message = str(exc)
            raise EdgeMoEError(message if path.name in message else f"{path.name}: {message}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise EdgeMoEError(f"{path.name}: bad or missing metadata {exc}") from None
    if not path.is_dir():
        raise EdgeMoEError(f"model path {path} does not exist, or is neither a folder nor a .gguf file")
    return (*read_config(path, mtp), None)
