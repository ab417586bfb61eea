"""GLM-4.5 (`glm4_moe`) around the engine: offloaded experts give transformers' greedy tokens too, the sigmoid router's
weight and correction bias stay float32 in a bfloat16 model (as transformers keeps them), the checkpoint's MTP layer is
there and skipped, and configs whose group limits cannot route are refused in one line. Greedy parity on both
checkpoint layouts is in tests/models/test_hf_parity.py; `route_grouped` against transformers' router in
tests/moe/test_router.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from edgemoe import LLM, SamplingParams
from edgemoe.errors import EdgeMoEError
from tests.conftest import hf_model, save_checkpoint
from tests.test_cli import assert_user_error, edgemoe

NEW = 20
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
CASES = ("glm-groups-qknorm-mtp", "glm-air-dense2")


def prompts(seed: int, lengths=(6, 29, 57)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", CASES)
def test_offloaded_matches_transformers(tiny_checkpoint, case: str) -> None:
    """12 cache slots for 16 experts a layer, all MoE layers sharing them: misses and evictions every step."""
    folder, hf = tiny_checkpoint(case, "per-expert")
    options = dict(moe_strategy="offload", moe_cache_slots=12, max_num_seqs=3, moe_collect_stats=True)
    llm = LLM(str(folder), progress=False, dtype="float32", **options)
    batch = prompts(11)
    for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
        assert out.token_ids == hf_greedy(hf, prompt)
    assert llm.engine.moe_stats()["total"]["evictions"] > 0


def test_router_stays_float32_in_bfloat16(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("glm-groups-qknorm-mtp", "per-expert")
    model = LLM(str(folder), progress=False, dtype="bfloat16").engine.model
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.shared_expert.up_proj.weight.dtype == torch.bfloat16
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert torch.equal(gate.weight, f.get_tensor("model.layers.1.mlp.gate.weight"))
        assert torch.equal(
            gate.e_score_correction_bias, f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        )


def test_mtp_layer_is_in_the_checkpoint_and_skipped(tiny_checkpoint) -> None:
    folder, hf = tiny_checkpoint("glm-groups-qknorm-mtp", "per-expert")
    layers = hf.config.num_hidden_layers
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        mtp = [k for k in f.keys() if k.startswith(f"model.layers.{layers}.")]
    assert f"model.layers.{layers}.eh_proj.weight" in mtp and f"model.layers.{layers}.mlp.gate.weight" in mtp
    model = LLM(str(folder), progress=False, dtype="float32").engine.model
    assert len(model.model.layers) == layers


def _bad_copy(folder, tmp_path, **change):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text()) | change
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_group=3), "n_group 3 must be an integer >= 1 that divides n_routed_experts 16"),
        (dict(n_group=0), "n_group 0 must be"),
        (dict(topk_group=5), r"topk_group 5 must be an integer in 1\.\.n_group 4"),
        (dict(n_group=16, topk_group=4), "n_group 16 leaves one expert a group"),
        (dict(topk_group=1, num_experts_per_tok=5), "num_experts_per_tok 5 is more than the experts of topk_group 1"),
    ],
)
def test_bad_groups_are_one_line(tiny_checkpoint, tmp_path, change, message) -> None:
    folder, _ = tiny_checkpoint("glm-groups-qknorm-mtp", "per-expert")
    with pytest.raises(EdgeMoEError, match=message) as err:
        LLM(str(_bad_copy(folder, tmp_path, **change)), progress=False)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)


def test_bad_groups_cli(tiny_checkpoint, tmp_path) -> None:
    folder, _ = tiny_checkpoint("glm-groups-qknorm-mtp", "per-expert")
    proc = edgemoe("generate", "--model", str(_bad_copy(folder, tmp_path, n_group=3)), "hi")
    assert_user_error(proc, "n_group 3 must be an integer >= 1 that divides n_routed_experts 16")


def test_no_shared_expert(tmp_path) -> None:
    """`n_shared_experts` 0: transformers writes zero-width shared-expert tensors, which are skipped."""
    hf = hf_model("glm4_moe", n_shared_experts=0, num_nextn_predict_layers=0)
    folder = save_checkpoint(hf, tmp_path / "glm-no-shared", "per-expert")
    llm = LLM(str(folder), progress=False, dtype="float32")
    assert llm.engine.model.model.layers[1].mlp.shared_expert is None
    batch = prompts(5, (9,))
    assert llm.generate(batch, GREEDY)[0].token_ids == hf_greedy(hf, batch[0])
