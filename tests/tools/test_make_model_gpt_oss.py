"""`make-model` for gpt_oss and the `gpt-oss-20b` / `gpt-oss-120b` geometries. The Hugging Face folder is one
transformers loads as `GptOssForCausalLM` with every tensor in place (float experts stacked, transposed and gate/up
interleaved as transformers stores them), and edgemoe's greedy tokens from it equal transformers' on prompts longer
than the sliding window. The GGUF file is the one llama.cpp's own converter (tests/models/llama_converter.py) writes
from that folder, tensor for tensor and key for key, and edgemoe decodes it as transformers decodes the folder."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.models.loader import count_parameters
from edgemoe.models.registry import FAMILIES
from edgemoe.tools.make_model import make_model
from edgemoe.tools.presets import PRESETS
from edgemoe.tools.random_weights import hf_config
from tests.models.llama_converter import convert

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(make-model's tiny float32 folder, its GGUF file of the same seed, transformers' model of the folder)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt-oss-make")
    folder = make_model(root / "hf", "gpt_oss", "tiny", dtype="float32")
    path = make_model(root / "gguf", "gpt_oss", "tiny", dtype="float32", format="gguf")
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return folder, path, hf.eval()


def test_folder_and_file_decode_as_transformers(checkpoint) -> None:
    """A prompt past the window (128) and one inside it; sliding and full layers alternate, YaRN over 1024 / 32."""
    folder, path, hf = checkpoint
    assert type(hf).__name__ == "GptOssForCausalLM"
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert hf.config.sliding_window == 128 and hf.config.rope_parameters["rope_type"] == "yarn"
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (150, 9)]
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p) :].tolist() for p in batch]
    assert len({t for r in refs for t in r}) > 6, "degenerate model: the comparison would prove little"
    for source in (folder, path):
        outs = LLM(str(source), progress=False, dtype="float32").generate(batch, GREEDY)
        assert [o.token_ids for o in outs] == refs, source


def _contents(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (t.tensor_type, np.array(t.data).copy()) for t in reader.tensors}
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general."))}
    return tensors, fields


def test_gguf_is_what_llama_cpp_writes(checkpoint, tmp_path) -> None:
    """Every tensor (name, type, shape, values) and every key but the general.* ones, as the converter writes them
    from the folder: experts split into gate and up from the interleaved rows and transposed, their biases, the
    sinks, YaRN's keys, the window."""
    folder, path, _ = checkpoint
    theirs, their_fields = _contents(convert(folder, tmp_path / "converted.gguf"))
    ours, our_fields = _contents(path)
    assert sorted(ours) == sorted(theirs)
    for name, (qtype, data) in theirs.items():
        assert ours[name][0] == qtype and ours[name][1].shape == data.shape, name
        assert np.array_equal(ours[name][1], data), name
    assert "blk.0.ffn_gate_exps.bias" in ours and "blk.0.attn_sinks.weight" in ours
    assert our_fields == their_fields


@pytest.mark.parametrize("name, total, active", [("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)])
def test_geometries(name: str, total: float, active: float) -> None:
    """The model cards' parameter counts (20.9 B total, 3.6 B active; 116.8 B, 5.1 B), counted on the meta device;
    the presets' config equals transformers' GptOssConfig defaults where they agree (the 120b's are its defaults)."""
    from transformers import GptOssConfig

    family = FAMILIES["gpt_oss"]
    geometry = {k: v for k, v in PRESETS[name].items() if k != "family"}
    config = hf_config("gpt_oss", geometry, 0, None)
    cfg = family.normalise(config)
    counted = count_parameters(cfg, family)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size + 2 * cfg.moe_intermediate_size + cfg.hidden_size
    embedding = cfg.vocab_size * cfg.hidden_size  # the cards count the unembedding as active, not the embedding
    active_counted = counted - cfg.num_layers * (cfg.num_experts - cfg.top_k) * per_expert - embedding
    assert abs(counted - total) / total < 0.01 and abs(active_counted - active) / active < 0.02, counted
    defaults = GptOssConfig().to_dict()  # (its layer types for as many layers as the preset has)
    defaults["layer_types"] = GptOssConfig(num_hidden_layers=config["num_hidden_layers"]).layer_types
    keys = ("hidden_size", "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
            "sliding_window", "vocab_size", "rms_norm_eps", "max_position_embeddings", "num_experts_per_tok",
            "layer_types", "attention_bias", "swiglu_alpha", "swiglu_limit")  # fmt: skip
    if name == "gpt-oss-120b":
        keys += ("num_hidden_layers", "num_local_experts")
    assert {k: config[k] for k in keys} == {k: defaults[k] for k in keys}
    assert config["rope_parameters"] == defaults["rope_parameters"] | {"rope_theta": 150000.0}


def test_bench_runs_the_geometry_on_the_cpu(tmp_path) -> None:
    """`edgemoe bench --geometry gpt-oss-20b --layers 1` on the CPU (about 30 s and 4.5 GB: the 201,088-row tables),
    built through the loader with its window and YaRN, decoding and prefilling."""
    import json

    from edgemoe.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--geometry", "gpt-oss-20b", "--layers", "1", "--device", "cpu", "--dtype", "bfloat16",
            "--moe-strategy", "resident", "--steps", "2", "--warmup", "1", "--context", "16", "--prefill", "16",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["geometry"] == "gpt-oss-20b" and result["layers"] == 1 and result["experts"] == 32
    assert result["runs"][0]["tok_s"] > 0 and result["prefill"]["runs"][0]["tokens"] == 16
