"""GGUF checkpoints (`--model FILE.gguf`), written by `edgemoe make-model --format gguf`: greedy output token-identical
to transformers loading the same file (`gguf_file=`, float32, CPU) for qwen3moe and qwen2moe with experts in every
block format (mixed between gate/up and down and between layers too); Mixtral and OLMoE, which transformers cannot
read as MoE GGUFs, against the safetensors checkpoint of the same weights; offloaded equals resident; experts kept
as stored; no dequantized copy held; bad files refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.errors import EdgeMoEError
from edgemoe.models.gguf import fit
from edgemoe.tools.make_model import make_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
_FILES: dict = {}


def gguf_file(tmp_path_factory, family: str, size: str, expert_dtype: str) -> Path:
    key = (family, size, expert_dtype)
    if key not in _FILES:
        out = tmp_path_factory.mktemp(f"{family}-{size}-{expert_dtype}")
        _FILES[key] = make_model(out, family, size, dtype="float32", format="gguf", expert_dtype=expert_dtype)
    return _FILES[key]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (3, 21)]


def transformers_greedy(path: Path, llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    cfg = llm.engine.model_config
    widths = dict(moe_intermediate_size=cfg.moe_intermediate_size)  # transformers reads neither from the file
    if cfg.model_type == "qwen2_moe":
        widths["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **widths).eval()
    out = []
    for prompt in batch:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize(
    "family, size, expert_dtype",
    [
        ("qwen3_moe", "tiny", "f32"),
        ("qwen3_moe", "tiny", "q8_0"),
        ("qwen3_moe", "tiny", "q4_0"),
        ("qwen3_moe", "tiny", "mxfp4"),
        ("qwen3_moe", "tiny-k", "q4_k_m"),  # gate/up Q4_K, down Q6_K
        ("qwen3_moe", "tiny-k", "q5_k"),
        ("qwen3_moe", "tiny-k", "mixed"),  # layers alternate Q4_K and Q8_0
        ("qwen3_moe", "tiny", "q5_0"),  # llama.cpp's stand-ins for Q4_K / Q5_K in rows not of 256-weight blocks
        ("qwen3_moe", "tiny", "q5_1"),
        ("qwen3_moe", "tiny-k", "tq2_0"),  # a format the kernels do not read: experts made dense at load
        ("qwen2_moe", "tiny", "q8_0"),  # a shared expert beside the routed ones
        ("qwen2_moe", "tiny-k", "q4_k_m"),
    ],
)
def test_greedy_matches_transformers(tmp_path_factory, family: str, size: str, expert_dtype: str) -> None:
    path = gguf_file(tmp_path_factory, family, size, expert_dtype)
    llm = LLM(str(path), progress=False, dtype="float32", max_num_seqs=2)
    batch = prompts()
    ours = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert ours == transformers_greedy(path, llm, batch)
    assert len({t for ids in ours for t in ids}) > 6, "degenerate model: the comparison would prove little"
    if expert_dtype not in ("f32", "tq2_0"):  # experts kept as stored: the file's blocks, byte for byte
        reader = gguf.GGUFReader(path)
        stored = {t.name: np.asarray(t.data) for t in reader.tensors}
        experts = llm.engine.model.model.layers[0].mlp.experts
        inter = experts.gate_up_proj.shape[1] // 2
        assert np.array_equal(experts.gate_up_proj[:, :inter].numpy(), stored["blk.0.ffn_gate_exps.weight"])
        assert np.array_equal(experts.down_proj.numpy(), stored["blk.0.ffn_down_exps.weight"])


@pytest.mark.parametrize("expert_dtype", ["q4_k_m", "mixed"])
def test_offloaded_equals_resident(tmp_path_factory, expert_dtype: str) -> None:
    path = gguf_file(tmp_path_factory, "qwen3_moe", "tiny-k", expert_dtype)
    batch = prompts()
    resident = [o.token_ids for o in LLM(str(path), progress=False, max_num_seqs=2).generate(batch, GREEDY)]
    for slots, policy in ((4, "lru"), (5, "scored"), (8, "lru")):
        llm = LLM(
            str(path), progress=False, max_num_seqs=2, moe_strategy="offload", moe_cache_slots=slots,
            moe_policy=policy, moe_collect_stats=True,
        )  # fmt: skip
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == resident, (slots, policy)
        assert llm.moe_stats()["total"]["misses"] > 0


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_matches_its_safetensors_checkpoint(tmp_path, family: str) -> None:
    """transformers reads a llama-architecture GGUF as a dense Llama and no OLMoE GGUF at all, so the oracle is the
    safetensors checkpoint of the same weights (held to transformers by test_hf_parity), its experts quantized on
    load to the same blocks."""
    path = make_model(tmp_path / "gguf", family, "tiny", dtype="float32", format="gguf", expert_dtype="q8_0")
    folder = make_model(tmp_path / "hf", family, "tiny", dtype="float32")
    batch = prompts()
    ours = [o.token_ids for o in LLM(str(path), progress=False, dtype="float32").generate(batch, GREEDY)]
    ref = LLM(str(folder), progress=False, dtype="float32", expert_dtype="q8_0")
    assert ours == [o.token_ids for o in ref.generate(batch, GREEDY)]


def test_size_1_dimensions_fit_and_others_are_refused() -> None:
    """A GGUF tensor fills its parameter whatever size-1 dimensions its writer added or dropped (Qwen2-MoE's
    shared-expert gate, [1, H] in the checkpoint: [H] from make-model, [1, H] in numpy order from llama.cpp's converter,
    tests/models/test_llama_converter.py); any other difference, even of the same element count, is refused."""
    t = torch.arange(6.0)
    for stored, shape in (((6,), [1, 6]), ((1, 1, 6), [1, 6]), ((1, 6), [6]), ((2, 3), [2, 1, 3]), ((2, 3), [2, 3])):
        fitted = fit(t.reshape(stored), shape, "f.gguf: tensor x")
        assert list(fitted.shape) == shape and torch.equal(fitted.flatten(), t)
    with pytest.raises(EdgeMoEError, match=r"^f.gguf: tensor x has shape \[2, 3\], the config implies \[3, 2\]$"):
        fit(t.reshape(2, 3), [3, 2], "f.gguf: tensor x")
    with pytest.raises(EdgeMoEError, match="has shape"):
        fit(t, [1, 5], "f.gguf: tensor x")


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path_factory) -> None:
    path = gguf_file(tmp_path_factory, "qwen3_moe", "tiny", "q8_0")
    llm, demo = LLM(str(path), progress=False), LLM(progress=False)
    for text in ("ROMEO.\nWhat news?", "café 日本 🙂", "  spaced\tout  "):
        assert llm.tokenizer.encode(text) == demo.tokenizer.encode(text)
    messages = [{"role": "user", "content": "What news from the court?"}]
    assert llm.tokenizer.apply_chat_template(messages) == demo.tokenizer.apply_chat_template(messages)


# What a process holds in tensors and numpy arrays, by address -> bytes: every storage that a live object reaches (a
# numpy view counts its owner; memory-mapped file pages are not allocations and are left out).
HELD = """
import gc, mmap
import numpy as np
import torch

def held():
    out = {}
    def array(a):
        while isinstance(a.base, np.ndarray):
            a = a.base
        if a.base is None or not isinstance(a.base, mmap.mmap):
            out[a.__array_interface__["data"][0]] = max(out.get(a.__array_interface__["data"][0], 0), a.nbytes)
    gc.collect()
    for o in gc.get_objects():
        for r in (o, *gc.get_referents(o)):
            if isinstance(r, torch.Tensor) and r.device.type == "cpu" and not r.is_meta:
                s = r.untyped_storage()
                out[s.data_ptr()] = max(out.get(s.data_ptr(), 0), s.nbytes())
            elif isinstance(r, np.ndarray):
                array(r)
    out.pop(0, None)
    return out
"""


def test_loading_keeps_no_dequantized_copy_of_the_experts(tmp_path) -> None:
    """What loading leaves allocated is the expert blocks as stored, the dense weights (float32 here), the KV cache and
    the RoPE table: not the file twice, nor the experts in float (3.8x their Q8_0 blocks). Counted as the bytes of the
    tensors and arrays that the load added and that stay alive, which no other process can move (the process's RSS
    grew by 50.2 MB against a 49.3 MB bound beside two CPU-bound processes: allocator and page-cache noise)."""
    path = make_model(tmp_path, "qwen3_moe", "small", dtype="float32", format="gguf", expert_dtype="q8_0")
    reader = gguf.GGUFReader(path)
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    dense = sum(int(t.n_elements) * 4 for t in reader.tensors if "_exps." not in t.name)
    del reader
    code = (
        HELD
        + f"""
from edgemoe import LLM
before = held()
llm = LLM({str(path)!r}, progress=False, dtype="float32", kv_cache_memory="4MiB")
after = held()
print(sum(n for ptr, n in after.items() if ptr not in before), llm.engine.kv.k.nbytes * 2)
"""
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown, kv = map(int, proc.stdout.split())
    assert 4 << 20 <= kv < 5 << 20  # kv_cache_memory, in whole blocks
    rope = 2 << 20  # cos and sin tables, [max_position_embeddings 4096, head_dim 32] float32 each, and small buffers
    assert experts + dense + kv <= grown <= experts + dense + kv + rope, (grown, experts, dense, kv)


def test_bad_files_are_refused_in_one_line(tmp_path, tmp_path_factory) -> None:
    good = gguf_file(tmp_path_factory, "qwen3_moe", "tiny", "q8_0")
    short = tmp_path / "short.gguf"
    short.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(EdgeMoEError, match="not a complete GGUF file"):
        LLM(str(short), progress=False)
    with pytest.raises(EdgeMoEError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), progress=False)
    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(other, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EdgeMoEError, match="architecture 'gpt2' is not supported"):
        LLM(str(other), progress=False)
    part = tmp_path / "model-00001-of-00002.gguf"
    part.write_bytes(good.read_bytes())
    with pytest.raises(EdgeMoEError, match="model-00002-of-00002.gguf is missing"):
        LLM(str(part), progress=False)
