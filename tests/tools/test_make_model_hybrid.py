"""`make-model --format gguf` for the hybrid families, qwen3_next (llama.cpp's `qwen3next`) and qwen3_5_moe_text
(`qwen35moe`): the file equals what llama.cpp's own converter (tests/models/llama_converter.py) writes from the Hugging
Face folder of the same seed, tensor for tensor and key for key (the norms with their 1 added, A as -exp(A_log), dt_bias
as ssm_dt.bias, the convolution 2-D, Qwen3-Next's in_proj_qkvz split and in_proj_ba kept, Qwen3.5's value heads in
tiled order, the shared expert's gate [1, H], the ssm keys); edgemoe decodes the file as it decodes the folder (which
tests/models/test_hybrid.py checks against transformers); and a Q4_K_M file loads with its experts as stored.

Random checkpoints have no MTP head, which the converter requires of these architectures unless told `--no-mtp`:
the file is the converter's with that option (no next-n block, no nextn_predict_layers key)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.errors import EdgeMoEError
from edgemoe.tools.make_model import make_model
from tests.models.llama_converter import convert

gguf = pytest.importorskip("gguf")

FAMILIES = {"qwen3_next": "qwen3next", "qwen3_5_moe_text": "qwen35moe"}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Factory: family -> (make-model's tiny float32 folder, its GGUF file of the same seed); once each."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"{family}-make")
            folder = make_model(root / "hf", family, "tiny", dtype="float32")
            cache[family] = folder, make_model(root / "gguf", family, "tiny", dtype="float32", format="gguf")
        return cache[family]

    return get


def _contents(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (t.tensor_type, np.array(t.data).copy()) for t in reader.tensors}
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general."))}
    return tensors, fields


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_is_what_llama_cpp_writes(made, family: str, tmp_path) -> None:
    """Every tensor (name, type, shape, values) and every key but the general.* ones."""
    folder, path = made(family)
    theirs, their_fields = _contents(convert(folder, tmp_path / "converted.gguf", pre="qwen2", options=("--no-mtp",)))
    ours, our_fields = _contents(path)
    assert sorted(ours) == sorted(theirs)
    for name, (qtype, data) in theirs.items():
        assert ours[name][0] == qtype and ours[name][1].shape == data.shape, name
        assert np.array_equal(ours[name][1], data), name
    assert our_fields == their_fields
    arch = FAMILIES[family]
    assert our_fields[f"{arch}.block_count"] == 3 and our_fields[f"{arch}.attention.recurrent_layers"] == [1, 1, 0]
    split = {"qwen3next": "blk.0.ssm_ba.weight", "qwen35moe": "blk.0.ssm_alpha.weight"}[arch]
    assert {"blk.0.ssm_a", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", split} <= set(ours)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_decodes_as_the_folder(made, family: str) -> None:
    folder, path = made(family)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (6, 40)]
    ref = [o.token_ids for o in LLM(str(folder), progress=False, dtype="float32").generate(batch, GREEDY)]
    assert len({t for ids in ref for t in ids}) > 6, "degenerate model: the comparison would prove little"
    assert [o.token_ids for o in LLM(str(path), progress=False, dtype="float32").generate(batch, GREEDY)] == ref


@pytest.mark.parametrize("family", list(FAMILIES))
def test_q4_k_m_file_keeps_the_experts_as_stored(tmp_path, family: str) -> None:
    """tiny-k (rows of whole 256-weight blocks): experts Q4_K (gate, up) and Q6_K (down), the dense matrices as
    llama-quantize's Q4_K_M types them, the convolution, norms and routers F32; edgemoe holds the experts' blocks byte
    for byte and decodes."""
    path = make_model(tmp_path, family, "tiny-k", format="gguf", expert_dtype="q4_k_m")
    reader = gguf.GGUFReader(path)
    stored = {t.name: (t.tensor_type, np.asarray(t.data)) for t in reader.tensors}
    types = {name: qtype for name, (qtype, _) in stored.items()}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ffn_up_exps.weight"] == Q.Q4_K
    assert types["blk.0.ffn_down_exps.weight"] == Q.Q6_K
    assert types["blk.0.attn_qkv.weight"] == types["blk.1.attn_v.weight"] == Q.Q6_K  # llama-quantize: both attn_v
    assert types["blk.0.ssm_out.weight"] == types["blk.1.attn_q.weight"] == Q.Q4_K
    f32 = ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_norm.weight", "blk.0.ffn_gate_inp_shexp.weight")
    assert {types[name] for name in f32} == {Q.F32}
    del reader
    llm = LLM(str(path), progress=False, dtype="float32", max_num_seqs=2)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert (experts.layout.q_gate_up.name, experts.layout.q_down.name) == ("Q4_K", "Q6_K")
    inter = experts.gate_up_proj.shape[1] // 2
    assert np.array_equal(experts.gate_up_proj[:, :inter].numpy(), stored["blk.0.ffn_gate_exps.weight"][1])
    assert np.array_equal(experts.down_proj.numpy(), stored["blk.0.ffn_down_exps.weight"][1])
    out = llm.generate([[11, 200, 3000, 45, 7]], GREEDY)[0].token_ids
    assert len(out) == GREEDY.max_tokens and len(set(out)) > 3


def test_a_gguf_package_without_the_architecture_is_one_line(tmp_path, monkeypatch) -> None:
    """(gguf packages before Qwen3.5 have no `qwen35moe`): refused before anything is written."""
    names = {arch: name for arch, name in gguf.MODEL_ARCH_NAMES.items() if name != "qwen35moe"}
    monkeypatch.setattr(gguf, "MODEL_ARCH_NAMES", names)
    with pytest.raises(EdgeMoEError, match="does not know llama.cpp's 'qwen35moe' architecture") as info:
        make_model(tmp_path / "m", "qwen3_5_moe_text", "tiny", format="gguf")
    assert "\n" not in str(info.value) and not (tmp_path / "m").exists()
