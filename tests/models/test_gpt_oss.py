"""gpt-oss (`gpt_oss`) with its experts as the Hub releases them, MXFP4 (`*_blocks` + `*_scales`, a
`quantization_config` of method mxfp4): a tiny checkpoint whose blocks and scales are fresh random bytes, so that
its weights are exactly what MXFP4 holds. transformers loads that very checkpoint on the CPU (`Mxfp4Config(dequantize=
True)`: its own dequantization, to float32) and is the oracle: greedy tokens identical, resident and offloaded, on
prompts longer than the sliding window; edgemoe keeps the blocks as stored (repacked, never dequantized at load), and
its dequantization of them is transformers'. The repacking is checked against the `gguf` package's MXFP4 too. Bad
input is refused in one line. Greedy parity of float checkpoints is in tests/models/test_hf_parity.py; the layers'
pieces against transformers' in tests/layers and tests/moe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe import LLM, SamplingParams
from edgemoe.errors import EdgeMoEError
from edgemoe.quant import dequantize, mxfp4_from_packed
from tests.conftest import hf_model, save_checkpoint

NEW = 20
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
WINDOW = 8
QUANT = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"]}  # fmt: skip


def mxfp4_checkpoint(folder: Path, into: Path, seed: int = 5) -> Path:
    """`folder`'s float gpt-oss checkpoint with its experts replaced by random MXFP4 ones in the Hub's layout: packed
    [E, rows, blocks, 16] and E8M0 scales [E, rows, blocks] (2^-5..2^-3: weights of about 1/sqrt(64))."""
    into.mkdir()
    state, g = load_file(folder / "model.safetensors"), torch.Generator().manual_seed(seed)
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n, rows = state.pop(name).shape  # transformers' [E, in, out]
        state[f"{name}_blocks"] = torch.randint(0, 256, (E, rows, n // 32, 16), generator=g, dtype=torch.uint8)
        state[f"{name}_scales"] = torch.randint(122, 125, (E, rows, n // 32), generator=g, dtype=torch.uint8)
    save_file(state, str(into / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text()) | {"quantization_config": QUANT}
    (into / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, into / name)
    return into


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(the MXFP4 checkpoint's folder, transformers' model of it, dequantized by transformers)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    root = tmp_path_factory.mktemp("gpt-oss")
    source = save_checkpoint(hf_model("gpt_oss", sliding_window=WINDOW), root / "float", "per-expert")
    folder = mxfp4_checkpoint(source, root / "mxfp4")
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    return folder, hf.eval()


def prompts(seed: int, lengths=(6, 29, 57)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("options", [{}, dict(moe_strategy="offload", moe_cache_slots=6, max_num_seqs=3)])
def test_mxfp4_checkpoint_matches_transformers(mxfp4, options: dict) -> None:
    """Prompts of 6, 29 and 57 tokens with a window of 8; offloaded: 6 slots for 24 experts, misses every step."""
    folder, hf = mxfp4
    llm = LLM(str(folder), progress=False, dtype="float32", max_num_batched_tokens=32, **options)  # chunked prefill
    batch = prompts(11)
    outs = [o.token_ids for o in llm.generate(batch, GREEDY)]
    for prompt, tokens in zip(batch, outs):
        assert tokens == hf_greedy(hf, prompt)
    assert len({t for ids in outs for t in ids}) > 8, "degenerate model: the comparison would prove little"


def test_experts_stay_mxfp4_blocks_equal_to_transformers_weights(mxfp4) -> None:
    """The experts are uint8 MXFP4 rows (not dequantized at load); dequantized, gate rows then up rows, they are
    transformers' weights (its even and odd columns) bit for bit."""
    folder, hf = mxfp4
    model = LLM(str(folder), progress=False, dtype="float32").engine.model
    for layer, theirs in zip(model.model.layers, hf.model.layers):
        experts, ref = layer.mlp.experts, theirs.mlp.experts
        assert experts.gate_up_proj.dtype == torch.uint8 and experts.layout.q_gate_up.name == "MXFP4"
        H, inter = hf.config.hidden_size, hf.config.intermediate_size
        gate_up = dequantize(experts.gate_up_proj, "MXFP4", H)  # [E, 2I, H]
        w13 = ref.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate and up interleaved
        assert torch.equal(gate_up[:, :inter], w13[:, 0::2]) and torch.equal(gate_up[:, inter:], w13[:, 1::2])
        assert torch.equal(dequantize(experts.down_proj, "MXFP4", inter), ref.down_proj.transpose(1, 2))
        bias = experts.gate_up_proj_bias
        assert torch.equal(bias, torch.cat((ref.gate_up_proj_bias[:, 0::2], ref.gate_up_proj_bias[:, 1::2]), 1))


def test_repacked_blocks_are_gguf_mxfp4() -> None:
    """Random packed bytes and scales: the `gguf` package's MXFP4 dequantization of the repacked rows equals
    transformers' of the Hub layout."""
    gguf = pytest.importorskip("gguf")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 4), generator=g, dtype=torch.uint8)
    rows = mxfp4_from_packed(packed, scales)  # [3, 5, 4 * 17]
    ours = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType.MXFP4).copy())
    theirs = convert_moe_packed_tensors(packed, scales, dtype=torch.float32).transpose(1, 2)  # [3, 5, 128]
    assert torch.equal(ours, theirs)


def _edited(folder: Path, into: Path, edit) -> Path:  # noqa: ANN001 - edit(state dict) in place
    into.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (into / f.name).symlink_to(f)
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


def test_scales_of_the_wrong_shape_are_one_line(mxfp4, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.down_proj_scales"

    def edit(state: dict) -> None:
        state[name] = state[name][:, :, :1].contiguous()

    with pytest.raises(EdgeMoEError, match=f"tensor {name} is torch.uint8 \\[8, 64, 1\\]; its blocks") as err:
        LLM(str(_edited(mxfp4[0], tmp_path / "bad", edit)), progress=False)
    assert "\n" not in str(err.value)


def test_requantizing_stored_experts_is_refused(mxfp4) -> None:
    with pytest.raises(EdgeMoEError, match="stored as mxfp4, which edgemoe keeps: expert_dtype q8_0") as err:
        LLM(str(mxfp4[0]), progress=False, expert_dtype="q8_0")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("split", [1, 8])
def test_cpu_expert_executor_computes_biased_mxfp4_experts(mxfp4, split: int) -> None:
    """`--moe-cpu-compute N`: the C executor computes N misses a step from the MXFP4 bank with the experts' biases and
    the clamped SwiGLU (8: every miss of a token); greedy tokens equal transformers'."""
    folder, hf = mxfp4
    llm = LLM(str(folder), progress=False, dtype="float32", moe_strategy="offload", moe_cache_slots=6, max_num_seqs=3,
              moe_cpu_compute=split, moe_collect_stats=True)  # fmt: skip
    batch = prompts(12, lengths=(6, 29))
    outs = [o.token_ids for o in llm.generate(batch, GREEDY)]
    for prompt, tokens in zip(batch, outs):
        assert tokens == hf_greedy(hf, prompt)
    assert llm.moe_stats()["total"]["cpu_computed"] > 0


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(swiglu_limit=5.0), "swiglu_limit = 5.0 is not supported"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type = 'linear' is not supported"),
        (dict(quantization_config={"quant_method": "fp8"}), "quant_method = 'fp8' is not supported"),
        (dict(layer_types=["sliding_attention"]), "layer_types = \\['sliding_attention'\\] is not supported"),
    ],
)
def test_unsupported_config_is_one_line(mxfp4, tmp_path: Path, change: dict, message: str) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in mxfp4[0].iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    (bad / "config.json").write_text(json.dumps(json.loads((mxfp4[0] / "config.json").read_text()) | change))
    with pytest.raises(EdgeMoEError, match=message) as err:
        LLM(str(bad), progress=False)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)
