"""`make-model --format gguf` against transformers' GGUF loader (the oracle) and the Hugging Face checkpoint of the
same seed: config, dense weights exactly, experts equal to gguf's numpy dequantization of the stored blocks (and,
where gguf can quantize, to its quantization of the Hugging Face experts).

transformers 5.24 reads `qwen2moe` and `qwen3moe` but not their `expert_feed_forward_length` /
`expert_shared_feed_forward_length` keys (it falls back to Qwen's real widths), so the tests pass those two;
it loads the `llama` architecture as a dense Llama (no experts) and has no `olmoe`: there the blocks are read with
gguf's own reader.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from edgemoe.cli import main
from edgemoe.tools.make_gguf import gguf_arch, llama_permute
from edgemoe.tools.make_model import make_model

Q = gguf.GGMLQuantizationType
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.BF16, Q.F16, Q.F32)  # gguf has a quantizer for these


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def blocks(reader: gguf.GGUFReader) -> dict[str, tuple[Q, torch.Tensor]]:
    """GGUF name -> (type, weights dequantized by gguf's numpy code, numpy shape)."""
    return {
        t.name: (t.tensor_type, torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))))
        for t in reader.tensors
    }


def hf_experts(ref: dict, layer: int) -> dict[str, torch.Tensor]:
    gate, up = ref[f"model.layers.{layer}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
    return {"gate": gate, "up": up, "down": ref[f"model.layers.{layer}.mlp.experts.down_proj"]}


def check_experts(stored: dict, ref: dict, layers: int) -> None:
    """Each stored expert tensor is gguf's quantization of the Hugging Face one (or random valid K blocks)."""
    for layer in range(layers):
        for kind, w in hf_experts(ref, layer).items():
            qtype, values = stored[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert values.shape == w.shape and torch.isfinite(values).all()
            if qtype in QUANTIZABLE:
                expected = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
                assert torch.equal(values, torch.from_numpy(expected)), (layer, kind, qtype)
            else:  # K types: random blocks of the Hugging Face weights' scale
                assert 0.3 < values.std() / w.std() < 3


def load(folder, gguf_file: str, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32, **overrides).eval()


@pytest.mark.parametrize(
    "family, dtype, expert_dtype",
    [
        ("qwen3_moe", "float32", "f32"),
        ("qwen2_moe", "float32", "q8_0"),
        ("qwen3_moe", "bfloat16", "q4_k_m"),
        ("qwen2_moe", "float16", "mixed"),
        ("qwen3_moe", "float32", "mxfp4"),
        ("qwen2_moe", "float32", "q5_k"),
    ],
)
def test_qwen_loads_in_transformers_as_the_hf_checkpoint(tmp_path, family, dtype, expert_dtype) -> None:
    from transformers import AutoModelForCausalLM

    hf = make_model(tmp_path / "hf", family, "tiny-k", dtype=dtype, seed=7)
    path = make_model(tmp_path / "g", family, "tiny-k", dtype=dtype, seed=7, format="gguf", expert_dtype=expert_dtype)
    assert path == tmp_path / "g" / "model.gguf" and sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]
    reader = gguf.GGUFReader(path)
    arch = field(reader, "general.architecture")
    assert arch == {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[family]
    ref_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    rc = ref_model.config
    overrides = {"moe_intermediate_size": field(reader, f"{arch}.expert_feed_forward_length")}
    if family == "qwen2_moe":
        overrides["shared_expert_intermediate_size"] = field(reader, f"{arch}.expert_shared_feed_forward_length")
    model = load(path.parent, path.name, **overrides)
    c = model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts",
                "num_experts_per_tok", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "norm_topk_prob", "head_dim", "bos_token_id", "eos_token_id"):  # fmt: skip
        assert getattr(c, key, None) == getattr(rc, key, None), key
    assert c.rope_parameters["rope_theta"] == rc.rope_parameters["rope_theta"]
    assert c.rms_norm_eps == pytest.approx(rc.rms_norm_eps)  # a float32 in the file
    ref, ours = ref_model.state_dict(), model.state_dict()
    assert ref.keys() == ours.keys()
    stored = blocks(reader)
    names = gguf.get_tensor_name_map(gguf_arch(family), c.num_hidden_layers)
    for name, w in ref.items():
        if ".experts." in name:
            continue
        base, suffix = name.rsplit(".", 1)
        kind, dense = stored[f"{names.get_name(base)}.{suffix}"]
        if kind in (Q.Q4_K, Q.Q6_K):  # a Q4_K_M file's matrices: random blocks, which transformers dequantizes
            assert torch.equal(ours[name], dense.reshape(w.shape)), name
        else:
            assert torch.equal(ours[name], w), name  # dense: the same draws in the same dtype
    if expert_dtype == "q4_k_m":  # as llama-quantize types a Q4_K_M file's matrices
        kinds = {n: k for n, (k, _) in stored.items()}
        assert kinds["blk.0.attn_q.weight"] == kinds["blk.1.attn_output.weight"] == Q.Q4_K
        assert kinds["blk.0.attn_v.weight"] == kinds["output.weight"] == Q.Q6_K
    for layer in range(c.num_hidden_layers):  # transformers' experts: the blocks' dequantization
        e = {k: stored[f"blk.{layer}.ffn_{k}_exps.weight"][1] for k in ("gate", "up", "down")}
        assert torch.equal(ours[f"model.layers.{layer}.mlp.experts.gate_up_proj"], torch.cat([e["gate"], e["up"]], 1))
        assert torch.equal(ours[f"model.layers.{layer}.mlp.experts.down_proj"], e["down"])
    check_experts(stored, ref, c.num_hidden_layers)
    if expert_dtype == "f32":  # nothing quantized: the same model
        ids = torch.tensor([[5, 17, 300, 4000, 12, 99]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref_model(ids).logits, rtol=0, atol=1e-5)


def test_mixtral_is_llama_with_permuted_q_k(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    hf = make_model(tmp_path / "hf", "mixtral", "tiny-k", dtype="float32", seed=3)
    path = make_model(tmp_path / "g", "mixtral", "tiny-k", dtype="float32", seed=3, format="gguf", expert_dtype="q4_0")
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.architecture") == "llama"
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    rc, ref = ref.config, ref.state_dict()
    assert field(reader, "llama.expert_count") == rc.num_local_experts
    assert field(reader, "llama.feed_forward_length") == rc.intermediate_size  # the experts' width
    model = load(path.parent, path.name)  # a dense Llama: its MLP is missing, the rest must equal Mixtral's
    assert type(model).__name__ == "LlamaForCausalLM"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "max_position_embeddings"):  # fmt: skip
        assert getattr(model.config, key) == getattr(rc, key), key
    assert model.config.head_dim == rc.hidden_size // rc.num_attention_heads
    ours = model.state_dict()
    dense = [n for n in ref if ".mlp." not in n]
    assert len(dense) == 3 + 6 * rc.num_hidden_layers
    for name in dense:
        assert torch.equal(ours[name], ref[name]), name  # q and k un-permuted by transformers
    stored = blocks(reader)
    q = stored["blk.0.attn_q.weight"][1]
    assert torch.equal(q, llama_permute(ref["model.layers.0.self_attn.q_proj.weight"], rc.num_attention_heads))
    for layer in range(rc.num_hidden_layers):
        assert torch.equal(stored[f"blk.{layer}.ffn_gate_inp.weight"][1], ref[f"model.layers.{layer}.mlp.gate.weight"])
    check_experts(stored, ref, rc.num_hidden_layers)


def test_olmoe_tensors_are_the_hf_checkpoints(tmp_path) -> None:
    from safetensors.torch import load_file

    hf = make_model(tmp_path / "hf", "olmoe", "tiny", layout="fused", dtype="float32", seed=1)
    path = make_model(tmp_path / "g", "olmoe", "tiny", dtype="float32", seed=1, format="gguf", expert_dtype="q8_0")
    reader = gguf.GGUFReader(path)
    ref = load_file(hf / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.OLMOE, 3)
    stored = blocks(reader)
    assert field(reader, "general.architecture") == "olmoe" and len(stored) == len(ref) + 3  # gate_up: two each
    for name, w in ref.items():
        if ".experts." not in name:
            base, suffix = name.rsplit(".", 1)
            assert torch.equal(stored[f"{names.get_name(base)}.{suffix}"][1], w), name
    check_experts(stored, ref, 3)


def test_expert_types_per_layer_and_cli(tmp_path, capsys) -> None:
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--family", "qwen3_moe", "--size", "tiny-k", "--layers", "3", "--format",
                 "gguf", "--expert-dtype", "mixed"]) == 0  # fmt: skip
    said = capsys.readouterr()
    assert re.fullmatch(rf"wrote {re.escape(str(out / 'model.gguf'))} \(\d+\.\d MB in \d+\.\d s\)", said.out.strip())
    assert said.err.startswith(
        f"edgemoe: writing {out}: random qwen3_moe weights (tiny-k, 3 layers, 6.1 M parameters, experts mixed, "
    )
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    for layer, q in enumerate((Q.Q4_K, Q.Q8_0, Q.Q4_K)):
        assert {types[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")} == {q}
    assert types["token_embd.weight"] == Q.BF16 and types["blk.0.attn_norm.weight"] == Q.F32
    assert types["blk.0.ffn_gate_inp.weight"] == Q.F32  # the router, as the converter keeps it
    assert "general.file_type" not in reader.fields and field(reader, "general.quantization_version") == 2
    path = make_model(tmp_path / "k", "qwen3_moe", "tiny-k", format="gguf", expert_dtype="q4_k_m")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.ffn_up_exps.weight"] == Q.Q4_K and types["blk.1.ffn_down_exps.weight"] == Q.Q6_K
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M


def test_user_errors_leave_no_file(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--size", "tiny", "--format", "gguf", "--expert-dtype", "q4_k"]) == 2
    assert "Q4_K rows hold a multiple of 256 weights" in capsys.readouterr().err
    assert main(["make-model", str(out), "--expert-dtype", "q8_0"]) == 2
    assert "--expert-dtype needs --format gguf" in capsys.readouterr().err
    assert main(["make-model", str(out), "--format", "gguf", "--expert-dtype", "q3_k"]) == 2
    assert "unknown expert dtype 'q3_k'" in capsys.readouterr().err
    calls = []

    def interrupted(self, tensor: np.ndarray, *args) -> None:  # a write cut short after two tensors
        calls.append(tensor)
        if len(calls) > 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_model(out, "qwen2_moe", "tiny", format="gguf")
    assert list(out.iterdir()) == []
