"""`edgemoe make-model`: write a random-weight checkpoint of a supported family in Hugging Face layout, or as one
GGUF file (`edgemoe.tools.make_gguf`).

For tests (tiny shapes) and benchmarks (real geometries, optionally truncated to fewer layers). The
tokenizer is the demo model's (byte-level BPE); larger vocabularies simply have ids it never produces. The Qwen
families split text before BPE with Qwen2's regex, as their real tokenizers do (GGUF pre-tokenizer `qwen2`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from edgemoe.engine.summary import count
from edgemoe.errors import EdgeMoEError
from edgemoe.tools.presets import PRESETS
from edgemoe.tools.random_weights import DTYPES, checkpoint_shapes, hf_config, random_tensors, tokenizer_files


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
    config = hf_config(family, geometry, vocab, layers)  # (an unknown family fails here)
    config["dtype"] = dtype
    if format == "gguf":
        from edgemoe.tools.make_gguf import gguf_arch

        gguf_arch(family)  # before anything is drawn: a gguf package too old for the family's files says so
    tokenizer, tokenizer_config = tokenizer_files(family)
    shapes = checkpoint_shapes(family, config)
    params = sum(math.prod(shape) for _, shape in shapes)
    stored = f"experts {expert_dtype or dtype}, dense {dtype}" if format == "gguf" else dtype
    print(
        f"edgemoe: writing {out}: random {family} weights ({size}, {config['num_hidden_layers']} layers, "
        f"{count(params)} parameters, {stored}) ...",
        file=sys.stderr,
        flush=True,
    )
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
    total = params * torch_dtype.itemsize
    with tqdm(total=total, desc="writing", unit="B", unit_scale=True, leave=False, disable=None) as bar:
        for name, t in random_tensors(family, config, layout, seed, torch_dtype):
            current[name] = t
            size_now += t.numel() * t.element_size()
            bar.update(t.numel() * t.element_size())
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
