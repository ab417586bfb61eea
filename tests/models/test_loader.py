"""Loading: sharded checkpoints with an index, both expert layouts, config variants, make-model output."""

from __future__ import annotations

import json

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.errors import EdgeMoEError
from edgemoe.models.registry import read_config
from edgemoe.tools.make_model import make_model

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[11, 22, 33, 44], list(range(100, 130))]


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
def test_make_model_layouts_and_shards_agree_with_transformers(tmp_path, family) -> None:
    from transformers import AutoModelForCausalLM

    a = make_model(tmp_path / "a", family, "tiny", layout="per-expert", dtype="float32")
    b = make_model(tmp_path / "b", family, "tiny", layout="fused", dtype="float32", shard_bytes=100_000)
    assert (b / "model.safetensors.index.json").is_file() and len(list(b.glob("*.safetensors"))) > 2
    outs_a = [o.token_ids for o in LLM(str(a), progress=False, dtype="float32").generate(PROMPTS, GREEDY)]
    outs_b = [o.token_ids for o in LLM(str(b), progress=False, dtype="float32").generate(PROMPTS, GREEDY)]
    assert outs_a == outs_b
    hf = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    for prompt, ours in zip(PROMPTS, outs_a):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
        assert ours == ref[0, len(prompt) :].tolist()


def test_rope_theta_top_level_or_parameters(tmp_path) -> None:
    folder = make_model(tmp_path / "m", "qwen2_moe", "tiny")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert read_config(folder)[0].rope_theta == 12345.0
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EdgeMoEError, match="rope type 'yarn' is not supported"):
        read_config(folder)


def test_shape_mismatch_and_missing_shard(tmp_path) -> None:
    folder = make_model(tmp_path / "m", "qwen2_moe", "tiny")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 40}))
    with pytest.raises(EdgeMoEError, match="has shape"):
        LLM(str(folder), progress=False)
    sharded = make_model(tmp_path / "s", "mixtral", "tiny", shard_bytes=100_000)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(EdgeMoEError, match="shards that are missing"):
        LLM(str(sharded), progress=False)


@pytest.mark.parametrize("text", ['["a list"]', '{"weight_map": ["not", "a", "map"]}', "\udcff"])
def test_malformed_shard_index_is_one_line(tmp_path, text: str) -> None:
    from edgemoe.models.loader import checkpoint_files

    (tmp_path / "model.safetensors.index.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(EdgeMoEError, match="malformed .*model.safetensors.index.json"):
        checkpoint_files(tmp_path)
