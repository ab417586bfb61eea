"""Where the loader puts dense weights: projections a GGUF file stores in block formats the kernels read stay as
stored (`QuantLinear`, swapped in for `DecodeLinear`s while the model is on the meta device), and the token embedding
may live in host memory (`HostEmbedding`). `edgemoe.layers.quant_linear` says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.quant_linear import HostEmbedding, QuantLinear
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.quant import QuantType

QKV = re.compile(r"^(.*\.self_attn)\.(q|k|v)_proj\.(weight|bias)$")  # row blocks of our qkv_proj
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Rows:
    """Where a checkpoint tensor lands among a module's output rows."""

    module: str
    start: int
    rows: int


def rows_of(name: str, model: MoEForCausalLM) -> Rows | None:
    """The `DecodeLinear` rows a checkpoint weight (Hugging Face name) fills, or None if it fills none."""
    m = QKV.match(name)
    if m:
        if m.group(3) != "weight":
            return None
        sizes = model.get_submodule(m.group(1)).qkv_sizes
        part = "qkv".index(m.group(2))
        return Rows(f"{m.group(1)}.qkv_proj", sum(sizes[:part]), sizes[part])
    path = name.removesuffix(".weight")
    if path == name:
        return None
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return Rows(path, 0, module.out_features) if isinstance(module, DecodeLinear) else None


def keep_quantized(model: MoEForCausalLM, formats: dict[str, QuantType], dtype: torch.dtype) -> dict[str, Rows]:
    """Swap every `DecodeLinear` whose rows the checkpoint's quantized weights (`formats`: Hugging Face name -> block
    format the kernels read) fill entirely for a `QuantLinear` of those formats (model on the meta device). A module
    with any part stored otherwise (floats, a format the kernels do not read) stays dense. -> the weights now kept as
    stored, by name, with their rows."""
    by_module: dict[str, list[tuple[Rows, QuantType, str]]] = {}
    for name, q in formats.items():
        rows = rows_of(name, model)
        if rows is not None:
            by_module.setdefault(rows.module, []).append((rows, q, name))
    kept = {}
    for path, parts in by_module.items():
        module = model.get_submodule(path)
        parts.sort(key=lambda p: p[0].start)
        ends = [0] + [r.start + r.rows for r, _, _ in parts]
        if [r.start for r, _, _ in parts] != ends[:-1] or ends[-1] != module.out_features:
            continue  # a part stored as floats (or in another format): the module stays dense
        runs: list[tuple[int, QuantType]] = []  # adjacent parts of one format merged: one launch each
        for r, q, _ in parts:
            if runs and runs[-1][1] == q:
                runs[-1] = (runs[-1][0] + r.rows, q)
            else:
                runs.append((r.rows, q))
        bias = module.bias is not None
        model.set_submodule(path, QuantLinear(module.in_features, module.out_features, runs, bias, dtype))
        kept.update({name: r for r, _, name in parts})
    return kept


def fill_quantized(model: MoEForCausalLM, rows: Rows, raw: torch.Tensor) -> str:
    """Copy a weight's raw blocks [rows, row_bytes] into its `QuantLinear` part. -> the part's buffer name."""
    module: QuantLinear = model.get_submodule(rows.module)
    for i, (start, n, _) in enumerate(module.parts):
        if start <= rows.start < start + n:
            module.raw(i)[rows.start - start : rows.start - start + rows.rows].copy_(raw)
            return f"{rows.module}.raw{i}"
    raise AssertionError(f"no part of {rows.module} holds rows from {rows.start}")


def quantized_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every `QuantLinear` part by buffer name (the loader's fill targets beside the parameters)."""
    return {
        f"{path}.raw{i}": m.raw(i)
        for path, m in model.named_modules()
        if isinstance(m, QuantLinear)
        for i in range(len(m.parts))
    }


def embedding_to_host(model: MoEForCausalLM, dtype: torch.dtype, pinned: bool) -> dict[str, torch.Tensor]:
    """The token embedding's table moved to host memory (a `HostEmbedding`; model on the meta device), unless the
    lm_head shares it (tied embeddings: the device needs the table anyway). -> {parameter name: host table}."""
    if model.config.tie_word_embeddings:
        return {}
    from edgemoe.offload.banks import allocate_bank

    embed = model.model.embed_tokens
    table = allocate_bank((embed.num_embeddings, embed.embedding_dim), dtype, pinned, "the token embedding")
    model.model.embed_tokens = HostEmbedding(table)
    return {EMBEDDING: table}
