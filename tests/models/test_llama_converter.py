"""GGUF files written by llama.cpp's own converter (`tests/models/llama_converter.py`: `convert_hf_to_gguf.py` of the
llama-cpp-python sdist, downloaded once and cached; skipped when it can be neither), not by edgemoe's writer: a tiny
checkpoint of every family edgemoe reads from GGUF, made by transformers' own classes, converted to f32. edgemoe loads
each file, its greedy tokens (float32, CPU) equal transformers' on the checkpoint the file came from, token for token,
and its tokenizer, built from the file's metadata, encodes text as the checkpoint's does. The Qwen2-MoE checkpoint has
a shared expert, whose gate the converter stores 2-D ([n_embd, 1]; make-model writes it 1-D): the file is checked to
hold it so, the case edgemoe refused before GGUF tensors were fitted to their size-1 dimensions. The GLM-4.5
checkpoint routes in groups and carries an MTP layer, which the converter writes as a next-n block that edgemoe skips;
its sigmoid router's weight and correction bias stay float32, as the file stores them, in a bfloat16 model. The
gpt-oss checkpoints: one of float experts (written f32), and one of MXFP4 blocks as the Hub's are, which the converter
repacks into GGUF's MXFP4 and edgemoe keeps as stored.

The converter runs unchanged but for one method: the checkpoints carry edgemoe's demo tokenizer, and the converter
accepts a byte-level BPE tokenizer only when a hash of its output is on its list of known models, which the demo
tokenizer's is not; `get_vocab_base_pre` is replaced to name its pre-tokenizer, GPT-2's split ("gpt-2"), which is
the split it uses. The converter's GLM vocabulary step looks up GLM's special tokens ([gMASK], <|user|>,
<|observation|>): the GLM checkpoint's tokenizer gets them as added tokens after the demo tokenizer's vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edgemoe import LLM, SamplingParams
from tests.conftest import TINY, VOCAB, hf_model, save_checkpoint
from tests.models.llama_converter import convert

gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# family -> (the file's architecture, transformers' config overrides): TINY's cases less what the converter cannot
# write. llama.cpp's Qwen2-/Qwen3-MoE have no dense layers between MoE ones (`mlp_only_layers`: "Can not map tensor
# model.layers.1.mlp.down_proj.weight"); its OLMoE converter writes no clip_qkv and an rms_norm_eps of 1e-5 (OLMoE's)
# whatever the config says. Qwen3-MoE keeps norm_topk_prob and Qwen2-MoE its absence: llama.cpp renormalises the
# former's top-k weights and never the latter's, the files say nothing of it.
CASES = {
    "qwen2_moe": ("qwen2moe", dict(TINY["qwen2-gqa-shared-dense"][1], mlp_only_layers=[])),
    "qwen3_moe": ("qwen3moe", dict(TINY["qwen3-head-dim"][1], mlp_only_layers=[])),
    "mixtral": ("llama", TINY["mixtral-gqa"][1]),
    "olmoe": ("olmoe", dict(TINY["olmoe-mha-clip"][1], clip_qkv=None, rms_norm_eps=1e-5)),
    "glm4_moe": ("glm4moe", dict(TINY["glm-groups-qknorm-mtp"][1], vocab_size=VOCAB + 16)),
    # the hybrids: two q/k heads for four value heads, so that Qwen3.5's file holds them in tiled order
    "qwen3_next": ("qwen3next", dict(attention_bias=True)),
    "qwen3_5_moe_text": ("qwen35moe", dict(linear_num_key_heads=2, linear_num_value_heads=4)),
    "gpt_oss": ("gpt-oss", TINY["gpt-oss-yarn-window"][1]),  # float experts: the converter writes them f32
}
HYBRIDS = ("qwen3_next", "qwen3_5_moe_text")
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


def add_mtp_head(folder: Path, model: torch.nn.Module) -> None:
    """The multi-token-prediction head a released Qwen3-Next / Qwen3.5 checkpoint carries (`mtp.*`: a projection of
    two normed inputs and one more full-attention layer), here a copy of the last layer's tensors: the converter
    requires it of Qwen3-Next and writes it as a next-n block after the decoder's, which edgemoe must leave out."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors, hidden = load_file(file), model.config.hidden_size
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    tensors |= {"mtp.layers.0." + k.removeprefix(last): v.clone() for k, v in tensors.items() if k.startswith(last)}
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    tensors |= {f"mtp.{n}.weight": torch.ones(hidden) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Factory: family -> (the converter's f32 file, the checkpoint's folder, transformers' model); once each."""
    cache: dict = {}

    def get(family: str) -> tuple[Path, Path, torch.nn.Module]:
        if family not in cache:
            if family == "mixtral":  # the llama architecture's vocabulary step imports it before looking for files
                pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece for Mixtral")
            model = hf_model(family, **CASES[family][1])
            folder = save_checkpoint(model, tmp_path_factory.mktemp(f"{family}-hf"), "per-expert")
            if family in HYBRIDS:
                add_mtp_head(folder, model)
            if family == "glm4_moe":
                add_special_tokens(folder, GLM_TOKENS)
            cache[family] = convert(folder, folder.parent / f"{family}.gguf"), folder, model
        return cache[family]

    return get


def add_special_tokens(folder: Path, tokens: tuple[str, ...]) -> None:
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    first = len(spec["model"]["vocab"])
    for i, token in enumerate(tokens):
        spec["added_tokens"].append(
            dict(id=first + i, content=token, single_word=False, lstrip=False, rstrip=False, normalized=False,
                 special=True)
        )  # fmt: skip
    path.write_text(json.dumps(spec))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (4, 11, 23)]


@pytest.mark.parametrize("family", list(CASES))
def test_greedy_matches_transformers_on_the_source_checkpoint(converted, family: str) -> None:
    path, folder, hf = converted(family)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == CASES[family][0]
    if family == "qwen2_moe":  # the converter's shared-expert gate: [n_embd, 1] in GGUF order, not squeezed
        shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == [hf.config.hidden_size, 1]
    del reader
    llm = LLM(str(path), progress=False, dtype="float32")
    batch = prompts()
    ours = [o.token_ids for o in llm.generate(batch, GREEDY)]
    for prompt, tokens in zip(batch, ours):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert tokens == out[0, len(prompt) :].tolist()
    assert len({t for ids in ours for t in ids}) > 6, "degenerate model: the comparison would prove little"
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(folder)
    for text in ("ROMEO.\nWhat news?", "café 日本 🙂", "  spaced\tout  ", "[gMASK]<sop><|user|>\nhi"):
        assert llm.tokenizer.encode(text) == source.encode(text)


def test_hybrid_files_hold_what_edgemoe_reads_as_stored(converted) -> None:
    """What the hybrids' greedy parity rests on, checked on the files themselves: the next-n block follows the
    decoder's (block_count one more, its tensors present), A is stored as -exp(A_log), and Qwen3.5's value heads are
    in tiled order (so a grouped reading would pair them with the wrong q/k heads) while Qwen3-Next's are not."""
    for family in HYBRIDS:
        path, _, hf = converted(family)
        reader = gguf.GGUFReader(path)
        arch, config = CASES[family][0], hf.config
        assert reader.fields[f"{arch}.block_count"].contents() == config.num_hidden_layers + 1
        assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
        names = {t.name: t for t in reader.tensors}
        assert f"blk.{config.num_hidden_layers}.nextn.eh_proj.weight" in names
        stored = torch.from_numpy(names["blk.0.ssm_a"].data.copy())
        a_log = hf.model.layers[0].linear_attn.A_log.detach()
        grouped, tiled = -a_log.exp(), -a_log.view(2, 2).t().reshape(-1).exp()  # 2 q/k heads x 2 value heads each
        assert not torch.equal(grouped, tiled)
        assert torch.equal(stored, tiled if arch == "qwen35moe" else grouped), family
        llm = LLM(str(path), progress=False, dtype="float32")
        assert llm.engine.model.config.num_layers == config.num_hidden_layers


def test_glm_groups_mtp_and_float32_router(converted) -> None:
    path, folder, hf = converted("glm4_moe")
    reader = gguf.GGUFReader(path)
    keys = ("expert_group_count", "expert_group_used_count", "nextn_predict_layers")
    assert [reader.fields[f"glm4moe.{k}"].contents() for k in keys] == [4, 2, 1]
    layers = hf.config.num_hidden_layers
    assert f"blk.{layers}.nextn.eh_proj.weight" in {t.name for t in reader.tensors}
    del reader
    model = LLM(str(path), progress=False, dtype="bfloat16").engine.model
    assert len(model.model.layers) == layers
    for i in range(hf.config.first_k_dense_replace, layers):
        ours, theirs = model.model.layers[i].mlp.gate, hf.model.layers[i].mlp.gate
        assert ours.weight.dtype == ours.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(ours.weight, theirs.weight)
        assert torch.equal(ours.e_score_correction_bias, theirs.e_score_correction_bias)


def test_qwen35_file_as_transformers_gguf_loader_reads_it(converted) -> None:
    """transformers' own GGUF loader reads `qwen35moe` files (tiled value heads, A as stored, the next-n block
    skipped): on the converter's file, its greedy tokens are ours."""
    from transformers import AutoModelForCausalLM

    path, _, _ = converted("qwen3_5_moe_text")
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(str(path), progress=False, dtype="float32")
    for prompt in prompts():
        ours = llm.generate([prompt], GREEDY)[0].token_ids
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert ours == out[0, len(prompt) :].tolist()


def test_a_layer_count_that_disagrees_with_the_tensors_is_one_line(converted, tmp_path) -> None:
    """A qwen3next file whose block_count says one block more or fewer than its tensors hold (edited in place): one
    line naming what disagrees, never a model of the wrong depth."""
    from edgemoe.errors import EdgeMoEError

    path, _, hf = converted("qwen3_next")
    data = path.read_bytes()
    key = b"qwen3next.block_count"
    at = data.index(key) + len(key) + 4  # the key, its uint32 type, then the value
    blocks = int.from_bytes(data[at : at + 4], "little")
    assert blocks == hf.config.num_hidden_layers + 1  # the decoder's and the next-n block
    for count, message in ((blocks - 1, "is past the file.s block_count"), (blocks + 1, "unexpected tensor blk")):
        bad = tmp_path / f"{count}.gguf"
        bad.write_bytes(data[:at] + count.to_bytes(4, "little") + data[at + 4 :])
        with pytest.raises(EdgeMoEError, match=message) as info:
            LLM(str(bad), progress=False, dtype="float32")
        assert "\n" not in str(info.value)


def test_gpt_oss_mxfp4_file_keeps_the_blocks(tmp_path: Path) -> None:
    """The Hub's kind of gpt-oss checkpoint (experts as MXFP4 blocks and scales): the converter repacks the blocks into
    GGUF's MXFP4 without dequantizing them, edgemoe keeps them as stored, and its greedy tokens equal those of
    transformers on the source checkpoint (dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tests.models.test_gpt_oss import mxfp4_checkpoint

    source = save_checkpoint(hf_model("gpt_oss", **TINY["gpt-oss-yarn-window"][1]), tmp_path / "float", "per-expert")
    folder = mxfp4_checkpoint(source, tmp_path / "mxfp4")
    path = convert(folder, tmp_path / "gpt-oss-mxfp4.gguf")
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name}
    assert kinds and set(kinds.values()) == {"MXFP4"}
    del reader
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    llm = LLM(str(path), progress=False, dtype="float32")
    assert llm.engine.model.model.layers[0].mlp.experts.layout.q_gate_up.name == "MXFP4"
    for prompt, out in zip(prompts(), llm.generate(prompts(), GREEDY)):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
