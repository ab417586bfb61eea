"""`edgemoe make-model`: write a random-weight checkpoint of a supported family in Hugging Face layout, or as one
GGUF file (`edgemoe.tools.make_gguf`).

For tests (tiny shapes) and benchmarks (real geometries, optionally truncated to fewer layers). The
tokenizer is the demo model's (byte-level BPE); larger vocabularies simply have ids it never produces. The Qwen
families split text before BPE with Qwen2's regex, as their real tokenizers do (GGUF pre-tokenizer `qwen2`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.models.gguf_tokenizer import QWEN2_SPLIT, byte_level_pre_tokenizer
from edgemoe.models.registry import FAMILIES

# geometry -> family and config fields (public config.json values for the real ones)
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        shared_expert_intermediate_size=48,
        vocab_size=None,
        max_position_embeddings=1024,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        intermediate_size=512,
        shared_expert_intermediate_size=512,
        vocab_size=None,
        max_position_embeddings=4096,
    ),
    # tiny, with every expert row a whole number of 256-weight blocks (the K types): GGUF tests
    "tiny-k": dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        intermediate_size=512,
        shared_expert_intermediate_size=256,
        vocab_size=None,
        max_position_embeddings=1024,
    ),
    "qwen3-30b-a3b": dict(
        family="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
        norm_topk_prob=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
    ),
    "qwen1.5-moe-a2.7b": dict(
        family="qwen2_moe",
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        intermediate_size=5632,
        shared_expert_intermediate_size=5632,
        vocab_size=151936,
        rope_theta=1e6,
        max_position_embeddings=8192,
    ),
    "mixtral-8x7b": dict(
        family="mixtral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        vocab_size=32000,
        rope_theta=1e6,
        max_position_embeddings=32768,
    ),
}
_PER_EXPERT = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}  # default: mlp, gate/up/down_proj
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# family -> how its tokenizer splits text before byte-level BPE, by llama.cpp's name (tokenizer.ggml.pre)
TOKENIZER_PRE = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen2", "mixtral": "gpt-2", "olmoe": "gpt-2"}


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
    if family == "qwen2_moe":
        return {
            **base,
            "architectures": ["Qwen2MoeForCausalLM"],
            "num_experts": g["num_experts"],
            "moe_intermediate_size": g["moe_intermediate_size"],
            "intermediate_size": g["intermediate_size"],
            "shared_expert_intermediate_size": g.get("shared_expert_intermediate_size", 0),
            "norm_topk_prob": g.get("norm_topk_prob", False),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "qkv_bias": True,
        }
    if family == "qwen3_moe":
        return {
            **base,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": g["num_experts"],
            "moe_intermediate_size": g["moe_intermediate_size"],
            "intermediate_size": g["intermediate_size"],
            "norm_topk_prob": g.get("norm_topk_prob", True),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": False,
            "head_dim": g.get("head_dim", g["hidden_size"] // g["num_attention_heads"]),
        }
    if family == "mixtral":
        return {
            **base,
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": g["num_experts"],
            "intermediate_size": g["moe_intermediate_size"],
            "sliding_window": None,
        }
    if family == "olmoe":
        return {
            **base,
            "architectures": ["OlmoeForCausalLM"],
            "num_experts": g["num_experts"],
            "intermediate_size": g["moe_intermediate_size"],
            "norm_topk_prob": False,
            "clip_qkv": None,
        }
    raise EdgeMoEError(f"unknown family {family!r}; supported: {', '.join(sorted(FAMILIES))}")


def _draw(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # norms near 1, not exactly 1, so that they matter in tests
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    fan_in = shape[-1] if "embed_tokens" not in name else 1  # unit-variance activations (embeddings: unit rows)
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def checkpoint_shapes(family: str, config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor, experts fused, in the order `random_tensors` draws them."""
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
    return shapes


def random_tensors(family: str, config: dict, layout: str, seed: int, dtype: torch.dtype):
    """Yield (checkpoint name, tensor) in Hugging Face naming, experts per-expert or fused."""
    gen = torch.Generator().manual_seed(seed)
    prefix, gate, up, down = _PER_EXPERT.get(family, ("mlp", "gate_proj", "up_proj", "down_proj"))
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
    families' splitting text with Qwen2's regex (TOKENIZER_PRE)."""
    from edgemoe.engine.engine import demo_model_path

    demo = demo_model_path()
    tokenizer, config = (demo / "tokenizer.json").read_text(), (demo / "tokenizer_config.json").read_text()
    if TOKENIZER_PRE[family] == "qwen2":
        tok = Tokenizer.from_str(tokenizer)
        tok.pre_tokenizer = byte_level_pre_tokenizer(QWEN2_SPLIT)
        tokenizer = tok.to_str(pretty=True)
    return tokenizer, config


def make_model(
    out: Path,
    family: str,
    size: str,
    layers: int | None = None,
    layout: str = "per-expert",
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = 2 << 30,
    format: str = "hf",
    expert_dtype: str | None = None,
) -> Path:
    """Write a random checkpoint into the folder `out`: Hugging Face layout (returns `out`), or with format "gguf"
    the one file `out/model.gguf` (returns its path), dense weights in `dtype`, experts in `expert_dtype` (default:
    `dtype`; `edgemoe.tools.make_gguf.EXPERT_DTYPES`)."""
    from edgemoe.engine.engine import demo_model_path

    if format not in ("hf", "gguf"):
        raise EdgeMoEError(f"format must be hf or gguf, not {format!r}")
    if expert_dtype is not None and format != "gguf":
        raise EdgeMoEError("--expert-dtype needs --format gguf")
    if size not in PRESETS:
        raise EdgeMoEError(f"unknown size {size!r}; choose from {', '.join(PRESETS)}")
    if layout not in ("per-expert", "fused"):
        raise EdgeMoEError("layout must be per-expert or fused")
    geometry = dict(PRESETS[size])
    family = geometry.pop("family", family)
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise EdgeMoEError("dtype must be bfloat16, float16 or float32")
    demo = demo_model_path()
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = hf_config(family, geometry, vocab, layers)
    config["dtype"] = dtype
    tokenizer, tokenizer_config = tokenizer_files(family)
    out.mkdir(parents=True, exist_ok=True)
    if format == "gguf":
        from edgemoe.tools.make_gguf import write_gguf

        name = f"edgemoe random {family} {size}"
        return write_gguf(out / "model.gguf", family, config, tokenizer, tokenizer_config, seed, expert_dtype, name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    (out / "tokenizer.json").write_text(tokenizer)
    (out / "tokenizer_config.json").write_text(tokenizer_config)
    shards: list[list[str]] = []  # tensor names per shard, written as each fills (bounded memory)
    current, size_now = {}, 0
    for name, t in tqdm(
        random_tensors(family, config, layout, seed, torch_dtype),
        desc="writing",
        unit="tensor",
        leave=False,
        disable=None,
    ):
        current[name] = t
        size_now += t.numel() * t.element_size()
        if size_now >= shard_bytes:
            _flush(out, shards, current)
            current, size_now = {}, 0
    if current:
        _flush(out, shards, current)
    _name_shards(out, shards)
    return out


def _flush(out: Path, shards: list[list[str]], tensors: dict) -> None:
    save_file(tensors, str(out / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
    shards.append(list(tensors))


def _name_shards(out: Path, shards: list[list[str]]) -> None:
    if len(shards) == 1:
        (out / "shard-0.tmp").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i}.tmp").rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
