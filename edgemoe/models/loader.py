"""Build a model on the meta device, then stream its weights from safetensors into place.

Checkpoints store routed experts either one tensor per expert (`...experts.N.gate_proj.weight`, Mixtral's
`w1/w3/w2`) or fused (`...experts.gate_up_proj`, transformers >= 5); both land in the fused banks.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from edgemoe.config import EXPERT_DTYPES, ModelConfig
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.kernels import select_kernels
from edgemoe.layers.ple import PLEOptions
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.models.dense_store import (
    EMBEDDING,
    QKV,
    Rows,
    embedding_to_host,
    fill_quantized,
    keep_quantized,
    quantized_buffers,
)
from edgemoe.models.gguf import EXPERT_PARTS, FLOAT_TYPES, GGUFCheckpoint, fit, gguf_files, stored_shape
from edgemoe.models.ple_store import Reader, place_ple
from edgemoe.moe.experts import carry_biases
from edgemoe.offload.banks import TierOptions, TierPlan
from edgemoe.offload.expert_store import source_identity
from edgemoe.offload.experts import ResidentExperts
from edgemoe.offload.in_place import CheckpointSpans
from edgemoe.offload.layout import QuantExpertLayout
from edgemoe.quant import QUANT_TYPES, QuantType, quant_type, quantize, random_blocks

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")  # after the family's `rename`
_EXPERT_BIAS = re.compile(r"^(.*\.experts)\.(gate|up)_proj_bias$")  # stacked gate or up biases (GGUF's), apart
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
GPU_PLE = PLEOptions()  # per-layer embeddings resident, as the family builds them


@dataclass(frozen=True)
class LoadOptions:
    """How the loader builds a model: for which device and dtype, and where each kind of weight goes.

    `offload`: routed experts in host banks (`edgemoe.offload.banks`) instead of the device. `expert_dtype`: a GGUF
    block format a safetensors checkpoint's experts are quantized to once (q8_0, q4_0, mxfp4, as the `gguf` package
    quantizes them; random weights: any format of `edgemoe.quant`), auto keeps `dtype`. `ple`: where
    per-layer embeddings live (`edgemoe.models.ple_store`). `host_embedding`: the token embedding's table in host
    memory, `dense_as_stored`: a GGUF's quantized projections kept as blocks (`edgemoe.models.dense_store`)."""

    device: torch.device
    dtype: torch.dtype
    progress: bool = True
    offload: bool = False
    expert_dtype: str = "auto"
    ple: PLEOptions = GPU_PLE
    host_embedding: bool = False
    dense_as_stored: bool = False
    tier: TierOptions | None = None  # `--ram-budget`: experts beyond it in an expert store on disk (offload)
    # a checkpoint tensor (by our name) -> this process's share of it (`--tensor-parallel`: `edgemoe.engine.parallel`)
    cut: TensorCut | None = None


class TensorCut(Protocol):
    """A tensor-parallel rank's share of each checkpoint tensor (`edgemoe.engine.parallel.Cut`): of `world` ranks, the
    routed experts' intermediate axis split in whole `unit`s of weights."""

    world: int
    unit: int

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor: ...

    def experts(self, t: torch.Tensor, dim: int, per_unit: int | None = None) -> torch.Tensor:
        """The share of a routed expert tensor's intermediate axis `dim` (`per_unit`: stored elements a unit)."""
        ...


def build_model(cfg: ModelConfig, family: ModuleType) -> MoEForCausalLM:
    """The family's model (its `MODEL` class where it has one, else `MoEForCausalLM`) over its `LAYER`s."""
    return getattr(family, "MODEL", MoEForCausalLM)(cfg, family.LAYER)


def count_parameters(cfg: ModelConfig, family: ModuleType) -> int:
    """The model's parameters, counted on the meta device (nothing allocated), whatever dtype experts are stored in."""
    with torch.device("meta"):
        model = build_model(cfg, family)
    model.tie_weights()  # a tied lm_head is the embedding: counted once
    return sum(p.numel() for p in model.parameters())


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted({str(n) for n in json.loads(index.read_text())["weight_map"].values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            shape = '{"weight_map": {tensor: shard file}}'
            raise EdgeMoEError(f"malformed {index}: expected {shape} ({exc})") from None
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EdgeMoEError(f"{index.name} names shards that are missing: {', '.join(missing[:3])}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EdgeMoEError(f"no *.safetensors weights in {folder}")
    return files


def load_model(folder: Path | None, cfg: ModelConfig, family: ModuleType, opts: LoadOptions) -> MoEForCausalLM:
    """The model of `folder`'s checkpoint (None: random weights, `fill_random`) built as `opts` says: on the meta
    device first, weights streamed into place, kernels chosen for the device."""
    layouts, dtype, expert_dtype = {}, opts.dtype, opts.expert_dtype
    stored = cfg.expert_format if folder is not None else None
    if stored and expert_dtype not in ("auto", stored):
        raise EdgeMoEError(
            f"this checkpoint's experts are stored as {stored}, which edgemoe keeps: expert_dtype {expert_dtype} "
            f"would quantize them twice (use auto or {stored})"
        )
    expert_dtype = stored or expert_dtype
    if expert_dtype != "auto":
        _check_rows(expert_dtype, cfg)
        q, (H, inter), act = quant_type(expert_dtype), (cfg.hidden_size, cfg.moe_intermediate_size), cfg.hidden_act
        layouts = {i: QuantExpertLayout(H, inter, q, q, dtype, act=act) for i, moe in enumerate(cfg.moe_layers) if moe}
    identity = {"random": 0, "config": repr(cfg)} if folder is None else source_identity(checkpoint_files(folder))
    model, host, readers, _, plan = _empty_model(cfg, family, opts, layouts, near=folder, identity=identity)
    with _discard_on_error(plan):
        if folder is None:
            _no_readers(readers, "random weights")
            fill_random(model, host)
        else:
            load_weights(model, folder, family, opts.progress, host | _resident_targets(model), readers, opts.cut)
    del host  # views of the expert store, if any: it is finished next
    return _ready(model, opts, plan)


@contextlib.contextmanager
def _discard_on_error(plan: TierPlan | None) -> Iterator[None]:
    """An expert store left unfinished by an error (or an interrupt) is removed."""
    try:
        yield
    except BaseException:
        if plan is not None:
            plan.source.discard()
        raise


def _check_rows(expert_dtype: str, cfg: ModelConfig) -> None:
    """A block format stores a row in whole blocks: refuse, in one line, a model whose expert rows are not, naming the
    row and the formats that fit. (Zero-padding the rows would keep the products exact, but every kernel and layout
    would then carry a second width: not worth it for the demo model, the only one seen with such rows.)"""
    rows = {"gate/up": ("hidden_size", cfg.hidden_size), "down": ("moe_intermediate_size", cfg.moe_intermediate_size)}

    def fits(name: str) -> bool:
        return all(n % quant_type(name).block_weights == 0 for _, n in rows.values())

    if fits(expert_dtype):
        return
    block = quant_type(expert_dtype).block_weights
    part, (field, width) = next((k, v) for k, v in rows.items() if v[1] % block)
    usable = [t for t in EXPERT_DTYPES[1:] if fits(t)]
    others = f"these fit: {', '.join(usable)}" if usable else "no expert_dtype fits this model"
    blocks = " or ".join(str(b) for b in sorted({quant_type(t).block_weights for t in EXPERT_DTYPES[1:]}))
    raise EdgeMoEError(
        f"expert_dtype {expert_dtype} stores rows in blocks of {block} weights, and this model's expert {part} rows "
        f"are {width} wide ({field}); {others} (each needs hidden_size and moe_intermediate_size in whole blocks of "
        f"{blocks}: Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, Mixtral-8x7B or make-model's tiny do, the demo model does not)"
    )


def _no_readers(readers: dict[str, Reader], source: str) -> None:
    if readers:
        raise EdgeMoEError(f"ple_backend disk maps its table from a safetensors checkpoint; {source} have none")


def _empty_model(
    cfg: ModelConfig,
    family: ModuleType,
    opts: LoadOptions,
    layouts: dict,
    dense_formats: dict[str, QuantType] | None = None,
    near: Path | None = None,
    identity: object = None,
    in_place: CheckpointSpans | None = None,
) -> tuple[MoEForCausalLM, dict[str, torch.Tensor], dict[str, Reader], dict[str, Rows], TierPlan | None]:
    """The model built on the meta device, dense weights kept quantized where `dense_formats` (name -> block format)
    says (`keep_quantized`), experts, per-layer embeddings and maybe the token embedding placed (`_place_experts`,
    `place_ple`, `embedding_to_host`), then given uninitialised storage on the device -> (model, the host banks and
    tables by parameter name, the tensors a backend reads itself by parameter name, the weights kept as stored, the
    RAM tier's plan where `opts.tier` asks for one: its expert store to finish once loaded, `near` the checkpoint's
    folder, `identity` the checkpoint's; or its experts read in place, where `in_place` says they can be)."""
    device, dtype = opts.device, opts.dtype
    with torch.device("meta"):
        model = build_model(cfg, family).to(dtype)
    keep_float32(model)
    kept = keep_quantized(model, dense_formats, dtype) if dense_formats else {}
    plan = None
    if opts.offload and opts.tier is not None:
        from edgemoe.offload.banks import plan_tier

        plan = plan_tier(model, dtype, layouts, opts.tier, near, identity, in_place)
    with _discard_on_error(plan):  # the store's file exists from here
        host = _place_experts(model, layouts, dtype, device, opts.progress, opts.offload, plan)
        if opts.host_embedding:
            host |= embedding_to_host(model, dtype, device.type == "cuda")
        ple_tables, readers = place_ple(model, opts.ple, device, dtype, opts.progress)
        model.to_empty(device=device)
        model.tie_weights()
    return model, host | ple_tables, readers, kept, plan


def keep_float32(model: torch.nn.Module) -> None:
    """The parameters that a module names in its `float32_parameters` (dotted paths below it) made float32 again
    after the model's cast to its dtype: small ones whose precision decides something (a sigmoid router's weight and
    correction bias, which transformers keeps in float32 too; a linear attention's decay rate, which it computes in
    float32)."""
    for module in model.modules():
        for path in getattr(module, "float32_parameters", ()):
            owner, _, name = path.rpartition(".")
            owner = module.get_submodule(owner)
            setattr(owner, name, torch.nn.Parameter(getattr(owner, name).float(), requires_grad=False))


def _ready(model: MoEForCausalLM, opts: LoadOptions, plan: TierPlan | None = None) -> MoEForCausalLM:
    """Weights in place: the expert store finished and its RAM tier attached (`plan`), the RoPE table built and the
    kernels chosen for the device."""
    device = opts.device
    if plan is not None:
        from edgemoe.offload.banks import attach_ram_tier

        attach_ram_tier(model, plan, device.type == "cuda")
    model.model.rotary.build(device)
    select_kernels(model, device)
    return model.eval().requires_grad_(False)


def _check_filled(params: dict[str, torch.Tensor], filled: dict[str, int], source: object) -> None:
    missing = [n for n, p in params.items() if filled[n] < p.numel()]
    if missing:
        raise EdgeMoEError(f"checkpoint {source} lacks {len(missing)} tensors, e.g. {', '.join(missing[:3])}")


def _place_experts(
    model: MoEForCausalLM, layouts: dict, dtype: torch.dtype, device: torch.device, progress: bool, offload: bool,
    plan: TierPlan | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Routed experts (model still on the meta device) into host banks (`offload`; `plan`'s source's where there is
    one: views of its expert store, or meta tensors) or, where `layouts` lay them out other than as parameters, into
    resident storage. -> the host banks by parameter name (the loader's targets)."""
    if offload:
        from edgemoe.offload.banks import offload_experts

        source = None if plan is None else plan.source
        return offload_experts(model, dtype, device.type == "cuda", progress, layouts, source)
    for i, layout in layouts.items():
        mlp = model.model.layers[i].mlp
        resident = ResidentExperts(model.config.num_experts, layout)
        carry_biases(mlp.experts, resident)
        mlp.experts = resident
    return {}


def _resident_targets(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """Resident experts' storage views by parameter name (they are buffers, not parameters)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(getattr(layer.mlp, "experts", None), ResidentExperts):
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = layer.mlp.experts.gate_up_proj
            out[f"model.layers.{i}.mlp.experts.down_proj"] = layer.mlp.experts.down_proj
    return out


@torch.no_grad()
def fill_random(model: MoEForCausalLM, host: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Random weights for benchmarks of real geometries: norms 1, biases 0, matrices N(0, 1/fan_in); the routed
    experts (device parameters or `host` banks alike, so resident and offloaded models hold the same values) a few
    random experts tiled, since filling tens of GB with fresh random numbers would dominate the run."""
    gen = torch.Generator(device=model.model.norm.weight.device).manual_seed(seed)
    if EMBEDDING in host:  # a host table gets what the device parameter (the first drawn) would
        table = host[EMBEDDING]
        table.copy_(torch.empty(table.shape, dtype=table.dtype, device=gen.device).normal_(0, 1, generator=gen))
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n} | _resident_targets(model)
    experts |= {n: t for n, t in host.items() if n != EMBEDDING}
    for name, p in model.named_parameters():
        if name in experts:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".self_attn.A"):  # a linear attention's decay rate: negative, or its state would grow
            p.fill_(-1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0, 1 / math.sqrt(p.shape[-1] if "embed_tokens" not in name else 1), generator=gen)
    cpu = torch.Generator().manual_seed(seed)
    for name, bank in sorted(experts.items()):  # by name: the same values resident and offloaded
        E, rest = bank.shape[0], bank.shape[1:]
        tile = math.gcd(E, 4)
        if bank.dtype == torch.uint8:  # GGUF blocks: valid random ones of the layer's format
            layout = model.get_submodule(name.rsplit(".", 1)[0]).layout
            q, n = (layout.q_down, layout.inter) if name.endswith("down_proj") else (layout.q_gate_up, layout.hidden)
            base = random_blocks((tile, *rest[:-1], n), q, cpu, std=1 / math.sqrt(n)).to(bank.device)
        else:
            base = (torch.randn(tile, *rest, generator=cpu) / math.sqrt(rest[-1])).to(bank.device, bank.dtype)
        bank.view(E // tile, tile, *rest).copy_(base.expand(E // tile, tile, *rest))


def load_weights(
    model: MoEForCausalLM,
    folder: Path,
    family: ModuleType,
    progress: bool = True,
    host: dict | None = None,
    readers: dict[str, Reader] | None = None,
    cut: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Fill the model's parameters, and the `host` tensors (name -> host bank) that stand in for some; hand the
    tensors of `readers` (name -> reader) to their readers, unread. `cut`: each tensor (by our name, once converted)
    -> the share of it this process holds."""
    params, readers = dict(model.named_parameters()) | (host or {}), readers or {}
    filled = dict.fromkeys(params, 0)
    files = checkpoint_files(folder)
    handles = [(f, safe_open(f, framework="pt", device="cpu")) for f in files]
    keys = [(f, h, k) for f, h in handles for k in h.keys()]
    read = set()
    with torch.no_grad():
        for file, handle, key in tqdm(
            keys, desc="loading weights", unit="tensor", disable=not progress or None, leave=False
        ):
            name = model.checkpoint_name(family.rename(key))
            if name is None:
                continue
            if name in readers:
                readers[name](file, key)
                read.add(name)
                continue
            if _in_reused_store(name, params):  # an expert the store already holds: not read at all
                pname, target = _target(name, params, model)
                filled[pname] += target.numel()
                continue
            for converted, tensor in model.convert(name, handle.get_tensor(key)):
                if cut is not None:
                    tensor = cut(converted, tensor)
                pname, target = _target(converted, params, model)
                if target is None:
                    continue
                if target.dtype == torch.uint8 and tensor.dtype != torch.uint8:  # quantize-on-load
                    tensor = quantize_rows(model, pname, tensor)
                elif tensor.dtype == torch.uint8 and target.dtype != torch.uint8:
                    raise EdgeMoEError(
                        f"tensor {key} holds quantized blocks, the config implies {target.dtype} weights"
                    )
                if list(tensor.shape) != list(target.shape):
                    raise EdgeMoEError(
                        f"tensor {key} has shape {list(tensor.shape)}, the config implies {list(target.shape)}"
                    )
                target.copy_(tensor)
                filled[pname] += target.numel()
    _check_filled(params, filled, folder)
    unread = sorted(set(readers) - read)
    if unread:
        raise EdgeMoEError(f"checkpoint {folder} lacks {', '.join(unread)}")


def _in_reused_store(name: str, params: dict[str, torch.Tensor]) -> bool:
    """Whether checkpoint tensor `name` (after renaming) fills an expert bank of a reused expert store (a meta tensor:
    `edgemoe.offload.expert_store.ExpertStore.banks`), so that reading it would be wasted. Names a family converts
    into other tensors (gpt-oss's blocks and scales) are read as usual, their copies then going nowhere."""
    m = _EXPERT.match(name)
    pname = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}" if m else name
    target = params.get(pname)
    return target is not None and target.is_meta


def quantize_rows(model: MoEForCausalLM, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's expert weights [..., rows, n] in the block format of `name`'s layer (quantize-on-load)."""
    layer = int(name.split(".")[2])
    layout = model.model.layers[layer].mlp.experts.layout
    q = layout.q_down if name.endswith("down_proj") else layout.q_gate_up
    return quantize(tensor, q)


def _target(name: str, params: dict[str, torch.nn.Parameter], model: MoEForCausalLM):
    """Checkpoint tensor name -> (our parameter name, the tensor view to fill), or (name, None) to skip."""
    m = _EXPERT.match(name)
    if m:
        bank, expert, part = m.group(1), int(m.group(2)), m.group(3)
        if part == "down":
            pname = f"{bank}.down_proj"
            return pname, _param(params, pname, name)[expert]
        pname = f"{bank}.gate_up_proj"
        w = _param(params, pname, name)[expert]
        half = w.shape[0] // 2
        return pname, w[:half] if part == "gate" else w[half:]
    m = _EXPERT_BIAS.match(name)
    if m:
        pname = f"{m.group(1)}.gate_up_proj_bias"
        b = _param(params, pname, name)
        half = b.shape[1] // 2
        return pname, b[:, :half] if m.group(2) == "gate" else b[:, half:]
    m = QKV.match(name)
    if m:
        pname = f"{m.group(1)}.qkv_proj.{m.group(3)}"
        qkv = _param(params, pname, name)
        sizes = model.get_submodule(m.group(1)).qkv_sizes  # the layer's own: layers may differ (Gemma-4's)
        part = "qkv".index(m.group(2))
        start = sum(sizes[:part])
        return pname, qkv[start : start + sizes[part]]
    if _IGNORED.search(name) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
        return name, None
    return name, _param(params, name, name)


def _param(params: dict[str, torch.nn.Parameter], pname: str, key: str) -> torch.Tensor:
    if pname not in params:
        raise EdgeMoEError(f"unexpected tensor {key} in the checkpoint (does config.json match the weights?)")
    return params[pname]


def expert_layouts(ckpt: GGUFCheckpoint, cfg: ModelConfig, dtype: torch.dtype) -> dict[int, QuantExpertLayout]:
    """Per MoE layer, the layout of its experts as the GGUF file stores them. gate and up share one format, down may
    differ, and so may layers: every layout then shares the longest row. Empty where the experts cannot stay as
    stored (floats, or a format the expert kernels do not read, or gate and up apart): they are then made dense."""
    formats, other = {}, set()
    for i, moe in enumerate(cfg.moe_layers):
        if not moe:
            continue
        kinds = [ckpt.expert_tensor(i, part).tensor_type for part in EXPERT_PARTS]
        try:
            gate, up, down = (quant_type(int(k)) for k in kinds)
        except ValueError:
            other.update(getattr(k, "name", str(k)) for k in kinds if int(k) not in FLOAT_TYPES)
            continue
        if gate != up:
            other.add(f"gate {gate.name} with up {up.name}")
            continue
        formats[i] = (gate, down)
    if other or len(formats) != sum(cfg.moe_layers):
        if other:
            print(
                f"edgemoe: {ckpt.path.name}: experts stored as {', '.join(sorted(other))}, which the expert kernels do "
                f"not read (they read {', '.join(QUANT_TYPES)}): dequantized to {str(dtype).removeprefix('torch.')}",
                file=sys.stderr,
            )
        return {}
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    own = {i: QuantExpertLayout(H, inter, *f, dtype, act=cfg.hidden_act) for i, f in formats.items()}
    row = max((layout.row for layout in own.values()), default=0)
    split = next((layout.split for layout in own.values()), 0)
    return {
        i: QuantExpertLayout(H, inter, *f, dtype, row=row, copy_split=split, act=cfg.hidden_act)
        for i, f in formats.items()
    }


def load_gguf(ckpt: GGUFCheckpoint, cfg: ModelConfig, family: ModuleType, opts: LoadOptions) -> MoEForCausalLM:
    """`load_model` for a GGUF checkpoint: routed experts kept as stored (their raw blocks copied from the
    memory-mapped file into host banks or device storage) unless stored as floats, or with a RAM tier read in place
    from the file where it can (`_in_place`); dense weights dequantized to the dtype, or with `opts.dense_as_stored`
    kept as stored where the kernels read their format (`QuantLinear`: the projections and lm_head of a Q4_K_M
    file)."""
    if opts.expert_dtype != "auto":
        raise EdgeMoEError("expert_dtype quantizes a safetensors checkpoint's experts; a GGUF's stay as stored")
    layouts = expert_layouts(ckpt, cfg, opts.dtype)
    formats = ckpt.dense_formats() if opts.dense_as_stored else None
    identity = source_identity(gguf_files(ckpt.path))
    spans = _in_place(ckpt, cfg, layouts, opts)
    model, host, readers, kept, plan = _empty_model(
        cfg, family, opts, layouts, formats, ckpt.path.parent, identity, spans
    )
    progress = opts.progress
    with _discard_on_error(plan), torch.no_grad():
        _no_readers(readers, "GGUF files")
        params = dict(model.named_parameters()) | host | quantized_buffers(model)
        filled = dict.fromkeys(params, 0)
        cut = opts.cut
        world = 1 if cut is None else cut.world
        heads = (cfg.num_heads * world, cfg.num_kv_heads * world)  # the file's (a rank's cfg has its share)
        tensors = ckpt.dense_tensors()
        for hf_name, tensor in tqdm(tensors, desc="loading weights", unit="tensor", disable=not progress or None):
            if hf_name in kept:  # blocks as stored
                rows, raw = kept[hf_name], ckpt.raw_rows(tensor, hf_name, heads)
                if raw.shape[0] != rows.rows:
                    raise EdgeMoEError(f"tensor {tensor.name} has {raw.shape[0]} rows, the config implies {rows.rows}")
                name = fill_quantized(model, rows, raw)
                filled[name] += raw.numel()
                continue
            name, target = _target(hf_name, params, model)
            if target is None:
                continue
            if cut is None:
                target.copy_(ckpt.to_torch(tensor, hf_name, heads, target.shape))
            else:  # the whole tensor, then this rank's share of it
                whole = ckpt.to_torch(tensor, hf_name, heads, stored_shape(tensor))
                target.copy_(fit(cut(hf_name, whole), target.shape, f"{ckpt.path.name}: tensor {tensor.name}"))
            filled[name] += target.numel()
        for i, moe in enumerate(
            tqdm(cfg.moe_layers, desc="loading experts", unit="layer", disable=not progress or None)
        ):
            if moe:
                filled.update(_fill_experts(ckpt, model, params, i, i in layouts, cut))
        _check_filled(params, filled, ckpt.path.name)
    del host, params  # views of the expert store, if any: it is finished next
    return _ready(model, opts, plan)


def _unit_bytes(q: QuantType, cut: TensorCut) -> int:
    """The bytes of one unit of the split (`cut.unit` weights) in a row of format `q`."""
    return cut.unit // q.block_weights * q.block_bytes


def _in_place(ckpt: GGUFCheckpoint, cfg: ModelConfig, layouts: dict, opts: LoadOptions) -> CheckpointSpans | None:
    """Where the file holds each MoE layer's experts as a host bank's row would, for the RAM tier to read them in place
    (`edgemoe.offload.in_place`): every layer's blocks kept as stored (`layouts`), or floats of the compute dtype; None
    where the loader converts a layer's experts (dequantized, or floats of another dtype), or no RAM tier reads them."""
    if not opts.offload or opts.tier is None or not ckpt.native_order:
        return None
    layers = []
    for i, moe in enumerate(cfg.moe_layers):
        if not moe:
            continue
        kinds = [int(ckpt.expert_tensor(i, part).tensor_type) for part in EXPERT_PARTS]
        if i not in layouts and any(FLOAT_TYPES.get(k) != opts.dtype for k in kinds):
            return None
        layers.append(tuple(ckpt.expert_span(i, part) for part in EXPERT_PARTS))
    return CheckpointSpans(ckpt.files, layers)


def _fill_experts(
    ckpt: GGUFCheckpoint, model: MoEForCausalLM, params: dict, layer: int, raw: bool, cut: TensorCut | None = None
) -> dict:
    """One layer's stacked experts into place: raw blocks as stored (`raw`), else as dense weights; with `cut`, a
    tensor-parallel rank's rows of gate and up and its blocks of each down row. -> filled counts."""
    prefix = f"model.layers.{layer}.mlp.experts"
    experts = model.model.layers[layer].mlp.experts
    w13 = params.get(f"{prefix}.gate_up_proj", experts.gate_up_proj)
    w2 = params.get(f"{prefix}.down_proj", experts.down_proj)
    inter = w13.shape[1] // 2
    for part, target in (("gate", w13[:, :inter]), ("up", w13[:, inter:]), ("down", w2)):
        if target.is_meta:  # read by the RAM tier, in place or from a reused store: not read here
            continue
        tensor = ckpt.expert_tensor(layer, part)
        if raw:  # blocks as stored: [E, rows, row bytes]
            t = torch.from_numpy(np.asarray(tensor.data))
            if cut is not None and part == "down":  # each row's blocks of the rank's share
                t = cut.experts(t, 2, per_unit=_unit_bytes(quant_type(int(tensor.tensor_type)), cut))
            elif cut is not None:
                t = cut.experts(t, 1)
        elif cut is not None:  # [E, I, H] gate and up, [E, H, I] down
            t = cut.experts(ckpt.to_torch(tensor, "", (1, 1), stored_shape(tensor)), 2 if part == "down" else 1)
        else:
            t = ckpt.to_torch(tensor, "", (1, 1), target.shape)
        target.copy_(fit(t, target.shape, f"{ckpt.path.name}: tensor {tensor.name}"))
    counts = {f"{prefix}.gate_up_proj": w13.numel(), f"{prefix}.down_proj": w2.numel()}
    return {name: n for name, n in counts.items() if name in params}
