"""Random weights of named families and geometries (the presets of `edgemoe.tools.presets`): their `config.json`,
every checkpoint tensor drawn from a seed, and the tokenizer files with the family's chat template. `make_model` writes
them as a Hugging Face folder, `make_gguf` as a GGUF file; `edgemoe bench` builds its models from the same presets."""

from __future__ import annotations

import json
import math

import torch
from tokenizers import Tokenizer

from edgemoe.errors import EdgeMoEError
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.models.gguf_tokenizer import QWEN2_SPLIT, byte_level_pre_tokenizer
from edgemoe.models.registry import FAMILIES, family_value
from edgemoe.tools.chat_templates import chat_template

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def hf_config(family: str, geometry: dict, vocab_size: int, layers: int | None) -> dict:
    """A config.json that both transformers and edgemoe read."""
    g = {**geometry, "vocab_size": geometry.get("vocab_size") or vocab_size}
    if layers:
        g["num_hidden_layers"] = layers
    base = {
        "model_type": family,
        "vocab_size": g["vocab_size"],
        "hidden_size": g["hidden_size"],
        "num_hidden_layers": g["num_hidden_layers"],
        "num_attention_heads": g["num_attention_heads"],
        "num_key_value_heads": g["num_key_value_heads"],
        "num_experts_per_tok": g["num_experts_per_tok"],
        "max_position_embeddings": g["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": g.get("rope_theta", 10000.0),
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    if "head_dim" in g:
        base["head_dim"] = g["head_dim"]
    own = getattr(FAMILIES.get(family), "random_config", None)  # each family writes its own fields
    if own is None:
        writes = sorted(t for t, m in FAMILIES.items() if hasattr(m, "random_config"))
        raise EdgeMoEError(f"unknown family {family!r}; supported: {', '.join(writes)}")
    return own(base, g)


def _draw(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # norms near 1, not exactly 1, so that they matter in tests
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    fan_in = shape[-1] if "embed_tokens" not in name else 1  # unit-variance activations (embeddings: unit rows)
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def checkpoint_shapes(family: str, config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor, experts fused, in the order `random_tensors` draws them (a family
    whose checkpoints name or shape its tensors otherwise lists them with its `checkpoint_shapes`)."""
    module = FAMILIES[family]
    with torch.device("meta"):
        model = MoEForCausalLM(module.normalise(config), module.LAYER)
    params = dict(model.named_parameters())
    shapes = []
    for name, p in params.items():
        if name.endswith("qkv_proj.bias"):
            continue  # listed with the weight
        if name.endswith("qkv_proj.weight"):  # Hugging Face's q_proj, k_proj, v_proj, each weight then its bias
            attn = name.removesuffix(".qkv_proj.weight")
            has_bias = f"{attn}.qkv_proj.bias" in params
            for part, rows in zip("qkv", model.get_submodule(attn).qkv_sizes):
                shapes.append((f"{attn}.{part}_proj.weight", (rows, p.shape[1])))
                if has_bias:
                    shapes.append((f"{attn}.{part}_proj.bias", (rows,)))
            continue
        shapes.append((name, tuple(p.shape)))
    checkpoint_names = getattr(module, "checkpoint_shapes", None)  # a family whose checkpoints name them otherwise
    return checkpoint_names(shapes, model.config) if checkpoint_names else shapes


def random_tensors(family: str, config: dict, layout: str, seed: int, dtype: torch.dtype):
    """Yield (checkpoint name, tensor) in Hugging Face naming, experts per-expert or fused (always stacked for a
    family whose checkpoints have no per-expert layout, `STACKED_EXPERTS`)."""
    gen = torch.Generator().manual_seed(seed)
    layout = "fused" if family_value(family, "STACKED_EXPERTS") else layout
    # per-expert names: mlp.experts.N.{gate,up,down}_proj, or the family's own (`CHECKPOINT_EXPERTS`)
    prefix, gate, up, down = family_value(family, "CHECKPOINT_EXPERTS", ("mlp", "gate_proj", "up_proj", "down_proj"))
    for name, shape in checkpoint_shapes(family, config):
        t = _draw(name, shape, gen).to(dtype)
        if ".experts." not in name or layout == "fused":
            yield name, t
            continue
        layer = name.split(".experts.")[0].replace(".mlp", f".{prefix}")
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                g, u = t[e].chunk(2)
                yield f"{layer}.experts.{e}.{gate}.weight", g.clone()
                yield f"{layer}.experts.{e}.{up}.weight", u.clone()
            else:
                yield f"{layer}.experts.{e}.{down}.weight", t[e].clone()


def tokenizer_files(family: str) -> tuple[str, str]:
    """The random checkpoints' tokenizer.json and tokenizer_config.json (texts): the demo model's, the Qwen
    families' splitting text with Qwen2's regex (TOKENIZER_PRE), each with its family's chat template
    (`edgemoe.tools.chat_templates`)."""
    from edgemoe.engine.engine import demo_model_path

    demo = demo_model_path()
    tokenizer, config = (demo / "tokenizer.json").read_text(), json.loads((demo / "tokenizer_config.json").read_text())
    if family_value(family, "TOKENIZER_PRE") == "qwen2":
        tok = Tokenizer.from_str(tokenizer)
        tok.pre_tokenizer = byte_level_pre_tokenizer(QWEN2_SPLIT)
        tokenizer = tok.to_str(pretty=True)
    template = chat_template(family_value(family, "TOOL_FORMAT"))
    return tokenizer, json.dumps({**config, "chat_template": template}, indent=1)
