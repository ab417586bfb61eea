"""`make-model` for glm4_moe (Hugging Face folder and GGUF) and the `glm-4.5-air` geometry: the folder is one
transformers reads, and edgemoe's greedy tokens from the folder and from the GGUF file equal transformers' on it."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.models.loader import count_parameters
from edgemoe.models.registry import FAMILIES
from edgemoe.tools.make_model import make_model
from edgemoe.tools.presets import PRESETS
from edgemoe.tools.random_weights import hf_config

pytest.importorskip("gguf")


def test_make_model_hf_and_gguf_match_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_model(tmp_path / "hf", "glm4_moe", "tiny", dtype="float32")
    path = make_model(tmp_path / "gguf", "glm4_moe", "tiny", dtype="float32", format="gguf")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    prompt = list(range(10, 37))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for source in (folder, path):
        assert LLM(str(source), progress=False, dtype="float32").generate([prompt], greedy)[0].token_ids == ref


def test_glm_45_air_geometry() -> None:
    """GLM-4.5-Air's shapes: about 106 B parameters and 12 B active besides the token embedding and lm_head (the
    model card's figures), its MTP layer not built."""
    family = FAMILIES["glm4_moe"]
    geometry = {k: v for k, v in PRESETS["glm-4.5-air"].items() if k != "family"}
    cfg = family.normalise(hf_config("glm4_moe", geometry, 0, None))
    assert cfg.moe_layers == (False,) + (True,) * 45 and cfg.rotary_dim == 64 and cfg.qkv_bias
    assert cfg.shared_expert_intermediate_size == 1408 and not cfg.family_config.qk_norm
    total = count_parameters(cfg, family)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    tables = 2 * cfg.vocab_size * cfg.hidden_size
    active = total - 45 * (cfg.num_experts - cfg.top_k) * per_expert - tables
    assert 105e9 < total < 108e9 and 11.5e9 < active < 12.5e9, (total, active)
