"""`edgemoe make-model --format gguf`: a random checkpoint as one GGUF file, written the way llama.cpp's converter
(convert_hf_to_gguf.py) writes the Hugging Face checkpoint that `make_model` draws from the same seed.

Names come from the gguf package's own tables; experts are stacked per layer (`blk.N.ffn_{gate,up,down}_exps`,
numpy shapes [E, I, H] and [E, H, I]); 1-D tensors, norms, the routers and the convolutions are F32, as the converter
writes them; the `llama` architecture (Mixtral) stores q and k with the converter's RoPE permutation; a family whose
converter splits, reorders or computes tensors says how (its `gguf_tensors`). Dense weights equal the Hugging Face
checkpoint's (same draws, same dtype) as the converter writes them, except in a `q4_k_m` file, whose matrices are
typed as llama-quantize's Q4_K_M types them (`dense_type`); experts in a float type equal them too, Q8_0 / Q4_0 /
MXFP4 are gguf's quantization of them, and the K types are random valid blocks (gguf has no K quantizer). The file is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.models.registry import FAMILIES, family_value
from edgemoe.quant import random_blocks
from edgemoe.tools.random_weights import DTYPES, checkpoint_shapes, random_tensors

Q = gguf.GGMLQuantizationType


def gguf_arch(family: str) -> gguf.MODEL_ARCH:
    """The gguf package's architecture of the family's GGUF architecture (`GGUF_ARCH`); EdgeMoEError where the
    installed gguf package predates it (as older ones predate `qwen3next` and `qwen35moe`)."""
    name = family_value(family, "GGUF_ARCH")
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if name not in by_name:
        raise EdgeMoEError(
            f"--format gguf: the installed gguf package does not know llama.cpp's {name!r} architecture ({family}'s "
            "files): upgrade it (pip install -U gguf)"
        )
    return by_name[name]


FLOAT_TYPES = {"float32": Q.F32, "float16": Q.F16, "bfloat16": Q.BF16}
# --expert-dtype -> general.file_type; q4_k_m: gate/up Q4_K, down Q6_K; mixed: layers alternate Q4_K and Q8_0
EXPERT_DTYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,  # llama.cpp's Q4_K where rows are not whole 256-weight blocks
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,  # and its Q5_K there
    "tq2_0": gguf.LlamaFileType.MOSTLY_TQ2_0,  # a format the expert kernels do not read: loaded as dense experts
    "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "mixed": None,
}
# the tensors the converter always writes F32 (besides 1-D ones and what is no `.weight`): norms, routers, convolutions
_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
_EXPERTS = {
    "gate": gguf.MODEL_TENSOR.FFN_GATE_EXP,
    "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
    "down": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
}


def expert_types(expert_dtype: str, layer: int) -> tuple[Q, Q]:
    """The GGML types of layer `layer`'s (gate and up, down) experts."""
    if expert_dtype == "q4_k_m":
        return Q.Q4_K, Q.Q6_K
    if expert_dtype == "mixed":
        q = Q.Q4_K if layer % 2 == 0 else Q.Q8_0
        return q, q
    return Q[expert_dtype.upper()], Q[expert_dtype.upper()]


def write_gguf(
    path: Path,
    family: str,
    config: dict,
    tokenizer: str,
    tokenizer_config: str,
    seed: int,
    expert_dtype: str | None,
    name: str,
) -> Path:
    """Write the checkpoint of `config` (make_model's config.json, dense weights in config["dtype"]) to `path`."""
    dense = FLOAT_TYPES[config["dtype"]]
    expert_dtype = expert_dtype or dense.name.lower()
    if expert_dtype not in EXPERT_DTYPES:
        raise EdgeMoEError(f"unknown expert dtype {expert_dtype!r}; choose from {', '.join(EXPERT_DTYPES)}")
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf_arch(family)])
    _add_hparams(writer, family, config, name, EXPERT_DTYPES[expert_dtype])
    _add_tokenizer(writer, config, tokenizer, tokenizer_config, family_value(family, "TOKENIZER_PRE"))
    plan = _plan(family, config, dense, expert_dtype)
    for gname, shape, qtype in (entry for entries in plan.values() for entry in entries):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            raise EdgeMoEError(f"{qtype.name} rows hold a multiple of {block} weights; {gname} has rows of "
                               f"{shape[-1]} (--size tiny-k fits every type)")  # fmt: skip
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype)))
        writer.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    partial = path.with_name(path.name + ".partial")
    try:
        _write(writer, partial, plan, family, config, seed)
    except BaseException:  # an interrupted write leaves no file, under either name
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    partial.rename(path)
    return path


def _write(writer: gguf.GGUFWriter, partial: Path, plan: dict, family: str, config: dict, seed: int) -> None:
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    blocks = torch.Generator().manual_seed(seed + 1)  # the K types' random blocks; `seed` draws what HF would hold
    total = sum(int(np.prod(gguf.quant_shape_to_byte_shape(s, q))) for e in plan.values() for _, s, q in e)
    with tqdm(total=total, desc="writing", unit="B", unit_scale=True, leave=False, disable=None) as bar:
        for hf_name, t in random_tensors(family, config, "fused", seed, DTYPES[config["dtype"]]):
            for (_, shape, qtype), (_, data) in zip(plan[hf_name], _parts(hf_name, t, config, family)):
                if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # random valid blocks, weights of the drawn scale
                    std = 1.0 if hf_name.endswith("embed_tokens.weight") else shape[-1] ** -0.5
                    raw = random_blocks(shape, int(qtype), blocks, std=std).numpy()
                else:
                    raw = gguf.quants.quantize(data.reshape(shape).float().contiguous().numpy(), qtype)
                writer.write_tensor_data(raw)
                bar.update(raw.nbytes)
    writer.close()


def _plan(family: str, config: dict, dense: Q, expert_dtype: str) -> dict[str, list[tuple[str, tuple, Q]]]:
    """Hugging Face name -> the GGUF tensors it becomes: (name, numpy shape, GGML type), in writing order."""
    names = gguf.get_tensor_name_map(gguf_arch(family), config["num_hidden_layers"])  # Hugging Face's -> GGUF's
    plan = {}
    for hf_name, shape in checkpoint_shapes(family, config):
        parts = _parts(hf_name, torch.empty(shape, device="meta"), config, family)
        plan[hf_name] = [_entry(names, name, tuple(t.shape), dense, expert_dtype) for name, t in parts]
    return plan


def _entry(names: gguf.TensorNameMap, name: str, shape: tuple, dense: Q, expert_dtype: str) -> tuple[str, tuple, Q]:
    """One part of a checkpoint tensor (`_parts`) -> its GGUF (name, numpy shape, GGML type)."""
    expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate|up|down)_proj\.(weight|bias)", name)
    if expert:  # [E, I, H] or [E, H, I]; biases [E, rows], F32 as every 1-D or non-weight tensor
        layer, kind, suffix = int(expert[1]), expert[2], expert[3]
        gate_up, down = expert_types(expert_dtype, layer)
        qtype = Q.F32 if suffix == "bias" else down if kind == "down" else gate_up
        return _expert_name(kind, layer).removesuffix(".weight") + f".{suffix}", shape, qtype
    # the converter's spelling of a routing bias (a parameter named `..._bias`, no `.bias` suffix)
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    gname = names.get_name(name, try_suffixes=(".weight", ".bias"))  # (a name without either: llama.cpp's too)
    if gname is None:
        raise EdgeMoEError(f"the gguf package has no GGUF name for {name}")
    f32 = len(shape) == 1 or gname.endswith(_F32) or not gname.endswith(".weight")
    return gname, shape, Q.F32 if f32 else dense_type(gname, shape, dense, expert_dtype)


def dense_type(gname: str, shape: tuple, dense: Q, expert_dtype: str) -> Q:
    """A dense matrix's GGML type: a Q4_K_M file's as llama-quantize types them (Q6_K for attn_v and attn_qkv, which it
    counts as one kind, ffn_down and the output, Q4_K for the others, where rows are whole 256-weight blocks), else the
    checkpoint's float type."""
    if expert_dtype != "q4_k_m" or shape[-1] % 256:
        return dense
    more_bits = any(f".{kind}." in gname for kind in ("attn_v", "attn_qkv")) or ".ffn_down" in gname
    more_bits |= gname == "output.weight"
    return Q.Q6_K if more_bits else Q.Q4_K


def _expert_name(kind: str, layer: int) -> str:
    return gguf.TENSOR_NAMES[_EXPERTS[kind]].format(bid=layer) + ".weight"


def _parts(hf_name: str, t: torch.Tensor, config: dict, family: str) -> list[tuple[str, torch.Tensor]]:
    """A Hugging Face tensor -> the tensors the converter writes of it (plan order), named as the gguf package's name
    map knows them: first what the family's converter does of its own (its `gguf_tensors`: renames, splits, values it
    computes, in float32 unless the tensor is float16 or float32, as the converter computes), then the stacked experts
    split into gate and up and the `llama` architecture's q/k permutation."""
    t = t if t.dtype in (torch.float16, torch.float32) else t.float()
    own = getattr(FAMILIES[family], "gguf_tensors", None)
    parts = own(hf_name, t, config) if own is not None else [(hf_name, t)]
    return [p for name, u in parts for p in _split(name, u, config, family)]


def _split(name: str, t: torch.Tensor, config: dict, family: str) -> list[tuple[str, torch.Tensor]]:
    """What the converter does of every architecture's tensors: stacked experts apart, q/k permuted for `llama`."""
    stem = name.rsplit(".", 1)[0] + "."
    if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows first
        gate, up = t.chunk(2, dim=1)
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    if name.endswith(".experts.down_proj"):  # [E, H, I]
        return [(stem + "down_proj.weight", t)]
    if family_value(family, "GGUF_PERMUTED_QK") and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        return [(name, llama_permute(t, heads))]
    return [(name, t)]


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for the `llama` architecture: within each head, the two rotary halves
    interleaved (rows j and j + d/2 become rows 2j and 2j + 1). transformers' GGUF loader undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_hparams(w: gguf.GGUFWriter, family: str, config: dict, name: str, ftype: int | None) -> None:
    """The hyperparameter keys convert_hf_to_gguf.py writes for this family: every family's (TextModel's
    set_gguf_parameters), then the family's own (its `gguf_hparams`)."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])  # Mixtral's and OLMoE's: the experts' width
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])  # OlmoeModel writes 1e-5 whatever the config says: not copied
    w.add_expert_count(config.get("num_local_experts") or config.get("n_routed_experts") or config["num_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    own = getattr(FAMILIES[family], "gguf_hparams", None)  # the keys a family writes of its own
    if own is not None:
        own(w, config)
    if ftype is not None:
        w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(w: gguf.GGUFWriter, config: dict, tokenizer: str, tokenizer_config: str, pre: str) -> None:
    """A byte-level BPE tokenizer as the converter's `_set_vocab_gpt2` writes it: tokens by id (ids the vocabulary
    lacks as unused `[PAD<id>]`), their types, then gguf's SpecialVocab (merges, special ids, add_bos_token, chat
    template) read from the same files."""
    spec = json.loads(tokenizer)
    added = {t["id"]: t for t in spec["added_tokens"]}
    by_id = {i: t for t, i in spec["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    tokens, types = [], []
    for i in range(config["vocab_size"]):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if i not in added:
            types.append(gguf.TokenType.NORMAL)
        elif added[i]["special"] or (by_id[i].startswith("<|") and by_id[i].endswith("|>")):
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "tokenizer.json").write_text(tokenizer)
        (folder / "tokenizer_config.json").write_text(tokenizer_config)
        ids = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        (folder / "config.json").write_text(json.dumps(ids))
        gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
