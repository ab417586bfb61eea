"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package's memory-mapped reader.

The config comes from the file's metadata, turned into the `config.json` fields our families normalise; tensors are
named as llama.cpp names them (`blk.N.attn_q.weight`) and renamed to Hugging Face's here, so the loader fills them
as it fills a safetensors checkpoint. Routed experts stay as stored (`expert_tensor`): the loader copies their raw
blocks into the banks, never holding a dequantized copy, or under a RAM budget leaves them where they are for the RAM
tier to read in place (`expert_span`: where each expert's bytes lie in the files).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload.in_place import Span
from edgemoe.quant import QUANT_TYPES, QuantType, dequantize, quant_type, row_bytes
from edgemoe.tokenizer import Tokenizer

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")
# llama.cpp's per-layer names -> Hugging Face's (the suffix .weight / .bias follows)
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_GLOBAL["output.weight"] = "lm_head.weight"
# a next-n (MTP) block's own tensors -> the head's parameters (`edgemoe.models.mtp`; the rest of the block is a layer)
_NEXTN = {
    "eh_proj": "mtp.fc",
    "enorm": "mtp.pre_fc_norm_embedding",
    "hnorm": "mtp.pre_fc_norm_hidden",
    "shared_head_norm": "mtp.norm",
    "shared_head_head": "mtp.head",
    "embed_tokens": "mtp.embed_tokens",
}
EXPERT_PARTS = ("gate", "up", "down")
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML type ids
_KERNEL_TYPES = {q.ggml_type for q in QUANT_TYPES.values()}  # the block formats the quantized kernels read


def gguf_files(path: Path) -> list[Path]:
    """`path` alone, or every part of a split set (`-00001-of-0000N.gguf`) given any of its parts."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise EdgeMoEError(f"{path.name} is part {m['part']} of {count}, but {', '.join(missing[:3])} is missing")
    return files


class GGUFCheckpoint:
    """One GGUF checkpoint (one file or a split set): metadata, and tensors by llama.cpp name."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path, self.readers, self.files = path, [], gguf_files(path)
        for file in self.files:
            try:
                self.readers.append(GGUFReader(file, "c"))  # copy-on-write: torch takes its arrays as writable
            except (ValueError, OSError, IndexError, KeyError) as exc:  # a short file fails inside numpy's memmap
                raise EdgeMoEError(f"cannot read {file}: not a complete GGUF file ({exc})") from None
        self.tensors = {t.name: t for r in self.readers for t in r.tensors}
        self.file_of = {t.name: i for i, r in enumerate(self.readers) for t in r.tensors}  # index into `files`
        self.arch = str(self.field("general.architecture"))
        # what the family says (`read_checkpoint`): llama.cpp's RoPE row permutation of q and k; the per-layer tensor
        # names only its architecture uses (llama.cpp's with suffix -> Hugging Face's)
        self.permuted_qk = False
        self.layer_tensors: dict[str, str] = {}
        self.mtp_blocks = 0  # the next-n blocks read as a multi-token-prediction head (`--speculative mtp`): 0 or 1

    def tokenizer(self) -> Tokenizer:
        """The tokenizer and chat template the file's metadata holds."""
        from edgemoe.models.gguf_tokenizer import tokenizer_from_gguf

        return Tokenizer.from_json(*tokenizer_from_gguf(self.readers[0]), self.path.name)

    def field(self, key: str, default: Any = ...) -> Any:
        field = self.readers[0].fields.get(key)
        if field is None:
            if default is ...:
                raise EdgeMoEError(f"{self.path.name}: metadata {key} is missing")
            return default
        return field.contents()

    @property
    def layers(self) -> int:
        """The decoder's blocks: llama.cpp counts the next-token-prediction (MTP) blocks that follow them in
        block_count; edgemoe reads the first as an MTP head where asked (`mtp_blocks`), else none."""
        a = self.arch
        return int(self.field(f"{a}.block_count")) - int(self.field(f"{a}.nextn_predict_layers", 0))

    def common_config(self) -> dict[str, Any]:
        """The metadata every family reads alike, as `config.json` fields (a family's `gguf_config` adds its own)."""
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        vocab = self.field(f"{a}.vocab_size", None) or int(self._tensor("token_embd.weight").shape[1])
        return dict(
            vocab_size=int(vocab), hidden_size=hidden, num_hidden_layers=self.layers,
            num_attention_heads=heads, num_key_value_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.field(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors, torch_dtype="bfloat16",
            num_experts_per_tok=int(self.field(f"{a}.expert_used_count")),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id", None),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id", None),
        )  # fmt: skip

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str):  # noqa: ANN202 - gguf's ReaderTensor
        if name not in self.tensors:
            raise EdgeMoEError(f"{self.path.name} lacks tensor {name}")
        return self.tensors[name]

    def dense_tensors(self) -> list[tuple[str, Any]]:
        """(Hugging Face name, reader tensor) of every tensor of the decoder's layers but the experts' weights, and of
        the next-n blocks read as an MTP head (`mtp_blocks`: its own tensors under `mtp.`, `_NEXTN`)."""
        out, layers, blocks = [], self.layers + self.mtp_blocks, int(self.field(f"{self.arch}.block_count"))
        for name, tensor in self.tensors.items():
            block = re.match(r"^blk\.(\d+)\.", name)
            if block and int(block[1]) >= blocks:
                raise EdgeMoEError(f"{self.path.name}: tensor {name} is past the file's block_count {blocks}")
            if name.endswith("_exps.weight") or block and int(block[1]) >= layers:  # (experts' biases are dense)
                continue
            nextn = re.match(r"^blk\.\d+\.nextn\.(\w+)\.weight$", name)
            if nextn and int(block[1]) >= self.layers:  # the head's own (a decoder block's: unexpected, below)
                if nextn[1] not in _NEXTN:
                    raise EdgeMoEError(f"{self.path.name}: unexpected tensor {name}")
                out.append((f"{_NEXTN[nextn[1]]}.weight", tensor))
                continue
            hf = _GLOBAL.get(name)
            m = re.match(r"^blk\.(\d+)\.(\w+)(?:\.(weight|bias))?$", name)  # (suffixless: qwen3next's ssm_a)
            own = m and (f"{m[2]}.{m[3]}" if m[3] else m[2])
            if m and own in self.layer_tensors:
                hf = f"model.layers.{m[1]}.{self.layer_tensors[own]}"
            elif m and m[3] and m[2] in _LAYER:
                hf = f"model.layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}"
            if hf is None:
                if name.startswith("rope_") or name.endswith(".rope_freqs.weight"):
                    continue
                raise EdgeMoEError(f"{self.path.name}: unexpected tensor {name}")
            out.append((hf, tensor))
        return out

    def to_torch(self, tensor: Any, hf_name: str, cfg_heads: tuple[int, int], shape: Sequence[int]) -> torch.Tensor:
        """A dense tensor as float32 in Hugging Face's layout (numpy order; llama's q/k rows un-permuted), in `shape`,
        the shape of what it fills (`fit`)."""
        kind = int(tensor.tensor_type)
        data = tensor.data
        if kind in FLOAT_TYPES:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16) if kind == 30 else None
            t = (t if t is not None else torch.from_numpy(np.ascontiguousarray(data))).float()
        else:
            try:
                q = quant_type(kind)
            except ValueError:
                q = None
            if q is not None:
                n = int(tensor.shape[0])
                t = dequantize(torch.from_numpy(np.ascontiguousarray(data)), q, n)
            else:
                from gguf.quants import dequantize as gguf_dequantize

                t = torch.from_numpy(gguf_dequantize(np.asarray(data), tensor.tensor_type)).float()
        t = fit(t.reshape(stored_shape(tensor)), shape, f"{self.path.name}: tensor {tensor.name}")
        if self.permuted_qk and re.search(r"self_attn\.(q|k)_proj\.weight$", hf_name):
            heads = cfg_heads[0] if ".q_proj." in hf_name else cfg_heads[1]
            t = unpermute(t, heads)
        return t

    def dense_formats(self) -> dict[str, QuantType]:
        """Hugging Face name -> block format, for every dense 2-D tensor stored in a format the kernels read."""
        out = {}
        for hf_name, tensor in self.dense_tensors():
            if len(tensor.shape) == 2 and int(tensor.tensor_type) in _KERNEL_TYPES:
                out[hf_name] = quant_type(int(tensor.tensor_type))
        return out

    def raw_rows(self, tensor: Any, hf_name: str, cfg_heads: tuple[int, int]) -> torch.Tensor:
        """A quantized dense tensor's blocks as stored, uint8 [rows, row_bytes], rows in Hugging Face's order (llama's
        q/k rows un-permuted, as `to_torch` does to the dequantized tensor)."""
        q = quant_type(int(tensor.tensor_type))
        n = int(tensor.shape[0])
        t = torch.from_numpy(np.ascontiguousarray(tensor.data)).reshape(-1, row_bytes(q, n))
        if self.permuted_qk and re.search(r"self_attn\.(q|k)_proj\.weight$", hf_name):
            t = unpermute(t, cfg_heads[0] if ".q_proj." in hf_name else cfg_heads[1])
        return t

    def expert_tensor(self, layer: int, part: str):  # noqa: ANN201 - gguf's ReaderTensor
        """One layer's stacked experts (`part`: gate, up or down), as stored: `.data` [E, rows, row bytes or
        elements], `.tensor_type` its GGML type."""
        return self._tensor(f"blk.{layer}.ffn_{part}_exps.weight")

    def expert_blocks(self, cfg: object) -> int:
        """The most weights a block of a routed expert's down rows holds, over `cfg`'s MoE layers (1 where they are
        floats, or in a format the loader dequantizes): where a down row may be cut."""
        most = 1
        for i, moe in enumerate(cfg.moe_layers):
            if moe:
                kind = int(self.expert_tensor(i, "down").tensor_type)
                if kind in _KERNEL_TYPES:
                    most = max(most, quant_type(kind).block_weights)
        return most

    def expert_span(self, layer: int, part: str) -> Span:
        """Where `expert_tensor(layer, part)` lies in `files`: each expert's bytes one run, one after the other."""
        t = self.expert_tensor(layer, part)
        count = int(t.shape[-1])  # GGML order: the experts are the last dimension
        return Span(t.name, self.file_of[t.name], int(t.data_offset), int(t.n_bytes) // count, count)

    @property
    def native_order(self) -> bool:
        """Whether the files' numbers are in this machine's byte order (not a byte-swapped file: read as stored)."""
        return all(r.byte_order == "I" for r in self.readers)


def stored_shape(tensor: Any) -> list[int]:
    """A GGUF tensor's shape in numpy's order, as stored (`fit` to it changes nothing)."""
    return [int(d) for d in reversed(tensor.shape)]


def fit(t: torch.Tensor, shape: Sequence[int], name: str) -> torch.Tensor:
    """`t` (the tensor `name` as stored) in `shape`, the shape of what it fills: writers add or drop size-1 dimensions
    (Qwen2-MoE's shared-expert gate, [1, hidden] in Hugging Face's checkpoint, is [hidden, 1] in GGUF order from
    llama.cpp's converter, [hidden] from make-model), so only the other dimensions, in order, must match."""
    if list(t.shape) != list(shape) and [d for d in t.shape if d != 1] != [d for d in shape if d != 1]:
        raise EdgeMoEError(f"{name} has shape {list(t.shape)}, the config implies {list(shape)}")
    return t.reshape(shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for the llama architecture (its RoPE pairs neighbours; ours halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
