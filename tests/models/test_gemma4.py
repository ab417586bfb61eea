"""Gemma-4 text against transformers' `Gemma4ForCausalLM` (float32, CPU, tiny random models): greedy tokens identical
to `generate` for a batch of prompts of different lengths, teacher-forced logits within 1e-4; offloaded experts equal
resident ones; a multimodal checkpoint loads its text model; unsupported config fields are refused in one line."""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from edgemoe import LLM, EdgeMoEError, SamplingParams, demo_model_path
from edgemoe.engine.kv_cache import KVCache, bytes_per_block
from edgemoe.models.registry import read_config
from tests.conftest import VOCAB
from tests.models.test_hf_parity import hf_greedy, prompts

S, F = "sliding_attention", "full_attention"
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
# Every case has sliding and global layers, a window (8) shorter than the longer prompts, global layers of their own
# head_dim (32) with proportional partial RoPE
CASES = {
    # per-layer embeddings only, tied embeddings
    "ple": dict(layer_types=[S, F, S, F], tie_word_embeddings=True),
    # MoE only; K = V on global layers with their own KV-head count; final logit soft-capping
    "moe-keqv-softcap": dict(
        **MOE, hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
        final_logit_softcapping=30.0, layer_types=[S, F, S, F],
    ),
    # both; the last two layers read earlier layers' KV caches (one sliding, one global), their MLPs double-wide;
    # attention biases
    "moe-ple-kvshared": dict(
        **MOE, num_hidden_layers=5, layer_types=[S, F, S, S, F], num_kv_shared_layers=2, use_double_wide_mlp=True,
        attention_bias=True,
    ),
}  # fmt: skip


def gemma_model(**overrides):
    """A transformers Gemma4ForCausalLM with small shapes and weights scaled so that outputs are not flat."""
    import transformers

    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=512, sliding_window=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    config = transformers.Gemma4TextConfig(**{**base, **overrides})
    torch.manual_seed(zlib.crc32(repr(sorted(overrides.items())).encode()))
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):  # norms, the router's scales
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:  # small: the embedding is scaled by sqrt(hidden), and tied models echo
                p.copy_(0.03 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


def save(model, folder: Path, layout: str) -> Path:
    """fused: transformers' save_pretrained (experts as `gate_up_proj`); per-expert: the experts split, and KV-shared
    layers keeping k/v weights of their own (unused, as transformers ignores them)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if layout == "per-expert":
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        for key in [k for k in state if k.endswith("experts.gate_up_proj")]:
            prefix = key[: -len("gate_up_proj")]
            gate_up, down = state.pop(key), state.pop(prefix + "down_proj")
            gate, up = gate_up.chunk(2, dim=1)
            for e in range(gate_up.shape[0]):
                for part, w in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                    state[f"{prefix}{e}.{part}.weight"] = w.clone()
        for i in range(model.config.num_hidden_layers - model.config.num_kv_shared_layers, len(model.model.layers)):
            state[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(32, 64)
            state[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.zeros(16)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(case, layout) -> (folder, transformers model), built once."""
    cache: dict = {}

    def get(case: str, layout: str = "fused"):
        if case not in cache:
            cache[case] = gemma_model(**CASES[case])
        if (case, layout) not in cache:
            cache[case, layout] = save(cache[case], tmp_path_factory.mktemp(f"{case}-{layout}"), layout), cache[case]
        return cache[case, layout]

    return get


def generate(folder: Path, batch: list[list[int]], **engine) -> list[list[int]]:
    llm = LLM(str(folder), progress=False, dtype="float32", **engine)
    outs = llm.generate(batch, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    return [out.token_ids for out in outs]


@pytest.mark.parametrize(
    ("case", "layout"), [("ple", "fused"), *((c, lay) for c in list(CASES)[1:] for lay in ("fused", "per-expert"))]
)
def test_greedy_matches_transformers(checkpoint, case: str, layout: str) -> None:
    folder, hf = checkpoint(case, layout)
    batch = prompts(len(case))
    outs = generate(folder, batch)
    assert outs == [hf_greedy(hf, p) for p in batch]
    assert len({t for out in outs for t in out}) > 8, "degenerate model: the comparison would prove little"


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoint, case: str) -> None:
    """Teacher-forced: transformers' greedy continuation through our (chunked) prefill and batched decode."""
    folder, hf = checkpoint(case)
    engine = LLM(
        str(folder), progress=False, dtype="float32", max_num_batched_tokens=16
    ).engine  # chunks cross the window
    batch = prompts(len(case) + 1)
    full = [p + hf_greedy(hf, p) for p in batch]
    with torch.no_grad():
        ref = [hf(torch.tensor([ids])).logits[0] for ids in full]  # [len, vocab]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=32, temperature=0)) for p in batch]
    checked = 0
    while engine.scheduler.has_work():
        step = engine.scheduler.schedule()
        due, logits = engine.runner.compute_logits(step)
        for seq, n in zip(step.seqs, step.num_new):
            seq.num_computed += n
        for row, i in enumerate(due):
            seq = step.seqs[i]
            k, pos = seqs.index(seq), len(seq.token_ids) - 1
            torch.testing.assert_close(logits[row], ref[k][pos], atol=1e-4, rtol=0)
            checked += 1
            if pos + 1 < len(full[k]):
                seq.token_ids.append(full[k][pos + 1])
            else:
                engine.scheduler.finish(seq)
    assert checked == len(batch) * 33


def test_offloaded_experts_equal_resident(checkpoint) -> None:
    folder, _ = checkpoint("moe-ple-kvshared")
    batch = prompts(7)
    offloaded = generate(folder, batch, moe_strategy="offload", moe_cache_slots=8)  # 8 of 40 experts
    assert offloaded == generate(folder, batch)


def test_multimodal_checkpoint_loads_its_text_model(checkpoint, tmp_path: Path) -> None:
    """A `gemma4` config with a `text_config` (as the Hub's are: global_head_dim, num_global_key_value_heads), its
    text weights under `model.language_model.`, towers beside them."""
    text_folder, hf = checkpoint("moe-keqv-softcap")
    text = json.loads((text_folder / "config.json").read_text())
    text.pop("per_layer_config")
    text.update(global_head_dim=32, num_global_key_value_heads=1, tie_word_embeddings=False)
    config = dict(model_type="gemma4", text_config=text, vision_config={"hidden_size": 8}, tie_word_embeddings=False)
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    state = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in hf.state_dict().items()}
    state |= {"model.vision_tower.patch_embedder.input_proj.weight": torch.zeros(8, 4)}
    state |= {"model.embed_vision.embedding_projection.weight": torch.zeros(64, 8)}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / name, tmp_path / name)
    batch = prompts(3)
    assert generate(tmp_path, batch) == [hf_greedy(hf, p) for p in batch]


def test_kv_shared_layers_read_their_source_cache(checkpoint) -> None:
    folder, _ = checkpoint("moe-ple-kvshared")
    cfg, _ = read_config(folder)
    assert [s for s, _, _ in cfg.kv_layers()] == [0, 1, 2, 2, 1]  # layer 3 (sliding) reads 2's, 4 (global) 1's
    kv = KVCache(cfg, 4, 16, torch.float32, torch.device("cpu"))
    assert kv.layers[3][0] is kv.layers[2][0] and kv.layers[4][1] is kv.layers[1][1]
    per_token = 2 * 16 + 2 * 32 + 2 * 16  # layers 0, 1, 2 (their own caches): kv heads x head_dim
    assert bytes_per_block(cfg, 16, torch.float32) == 2 * 16 * per_token * 4  # k and v, 16 tokens, float32
    assert kv.k.numel() == (4 + 1) * 16 * per_token  # 4 blocks and the pad block


def test_per_layer_embeddings_rows_match_transformers(checkpoint) -> None:
    """The PLE interface: `rows(ids)` is transformers' `get_per_layer_inputs`."""
    folder, hf = checkpoint("ple")
    model = LLM(str(folder), progress=False, dtype="float32").engine.model
    ids = torch.tensor([3, 17, 5000, 17])
    rows = model.model.embed_tokens_per_layer.rows(ids)
    assert rows.shape == (4, 4, 8)
    torch.testing.assert_close(rows, hf.model.get_per_layer_inputs(ids[None])[0], atol=0, rtol=0)


def test_rows_are_read_after_the_first_layers_feed_forward(checkpoint) -> None:
    """The backend's rows are first needed by the first layer's per-layer input, after its attention and MLP: a
    wait-sync graph waits there, so the host's read hides behind that work (the order of calls in each forward pass
    of a generation: the prefill and a decode step)."""
    folder, _ = checkpoint("ple")
    llm = LLM(str(folder), progress=False)
    model = llm.engine.model.model
    order: list[str] = []
    hooks = [
        model.layers[0].mlp.register_forward_hook(lambda *_: order.append("layer 0 mlp")),
        model.layers[1].self_attn.register_forward_hook(lambda *_: order.append("layer 1 attention")),
    ]
    backend = model.embed_tokens_per_layer
    rows = backend.rows
    backend.rows = lambda ids: (order.append("rows"), rows(ids))[1]  # rows() is a method, not the module's forward
    try:
        llm.generate([[3, 17, 5]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        for h in hooks:
            h.remove()
        del backend.rows
    assert order == ["layer 0 mlp", "rows", "layer 1 attention"] * 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_bidirectional_attention", "all"),
        ("hidden_activation", "relu"),
        (
            "rope_parameters",
            {S: {"rope_type": "default", "rope_theta": 1e4}, F: {"rope_type": "yarn", "rope_theta": 1e6}},
        ),
        ("per_layer_config", {"1": {"head_dim": 32, "sliding_window": 4}}),
        ("num_kv_shared_layers", 4),
    ],
)
def test_unsupported_field_is_refused_in_one_line(checkpoint, tmp_path: Path, field: str, value) -> None:
    folder, _ = checkpoint("ple")
    config = json.loads((folder / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgeMoEError) as err:
        read_config(tmp_path)
    message = str(err.value)
    assert field in message and "\n" not in message
