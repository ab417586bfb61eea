"""The hybrid linear-attention families (Qwen3-Next, Qwen3.5/3.6 MoE) around the engine: a Qwen3.5 checkpoint as the
Hub ships it (a vision tower beside the language model), each sequence's state slot through scheduling that changes
nothing (chunks, one at a time, preemption, offloaded experts), slots all returned, and bad checkpoints refused in
one line. Greedy tokens are compared with transformers' own classes (tests/models/test_hf_parity.py holds the
per-family parity on both checkpoint layouts)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.kv_cache import bytes_per_block
from edgemoe.errors import EdgeMoEError
from edgemoe.models.registry import read_config
from tests.conftest import VOCAB, save_checkpoint

NEW = 20
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def prompts(seed: int, lengths=(7, 33, 70)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def next_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3next-dense", "per-expert")


@pytest.fixture(scope="module")
def reference(next_checkpoint) -> dict:
    _, hf = next_checkpoint
    batch = prompts(3)
    return {"prompts": batch, "tokens": [hf_greedy(hf, p) for p in batch]}


def test_qwen35_as_the_hub_ships_it(tmp_path) -> None:
    """`Qwen3_5MoeForConditionalGeneration`: the language model under model.language_model, a vision tower under
    model.visual (skipped), the text fields under text_config."""
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, max_position_embeddings=512)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    torch.manual_seed(5)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p) + (1 if ".linear_attn.norm" in name else 0))
            elif "embed_tokens" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif p.numel() and p.dim() > 1:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    folder = save_checkpoint(model, tmp_path / "qwen35", "per-expert")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "qwen3_5_moe" and "text_config" in saved
    llm = LLM(str(folder), progress=False, dtype="float32")
    batch = prompts(4, (9, 40))
    for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
        assert out.token_ids == hf_greedy(model, prompt)
    assert len({t for t in out.token_ids}) > 5, "degenerate model: the comparison would prove little"


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=8),  # every prompt in chunks, each from its slot's state
        dict(max_num_seqs=1),  # one at a time: each sequence gets a slot another one used
        dict(moe_strategy="offload", moe_cache_slots=9, max_num_batched_tokens=16),
        "preempt",  # a KV cache too small for all three: a preempted sequence restarts from a cleared slot
    ],
)
def test_scheduling_keeps_each_sequence_state(next_checkpoint, reference, options) -> None:
    folder, _ = next_checkpoint
    if options == "preempt":
        per_block = bytes_per_block(read_config(folder)[0], 16, torch.float32)
        options = dict(kv_cache_memory=9 * per_block, block_size=16)  # 9 blocks; 2 + 4 + 6 are needed at the end
    llm = LLM(str(folder), progress=False, dtype="float32", **options)
    preempted = []
    original = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda s: (preempted.append(s.seq_id), original(s))
    outs = llm.generate(reference["prompts"], GREEDY)
    assert [o.token_ids for o in outs] == reference["tokens"]
    states = llm.engine.states
    assert sorted(states.free) == list(range(states.num_slots))  # every slot back
    assert llm.engine.kv.num_free == llm.engine.kv.num_blocks
    assert ("kv_cache_memory" in options) == bool(preempted)


def test_prefix_reuse_resumes_from_state_snapshots(next_checkpoint) -> None:
    """An agent's next turn (prompt + answer + a new message) resumes from the snapshot of the linear layers' state
    at the answer's last block boundary, and a request that shares only the first prompt's start from the prompt's
    last snapshot (a chunk end): greedy tokens identical to transformers and to the engine without the prefix cache,
    `cached_tokens` exactly those boundaries, every slot and block back."""
    folder, hf = next_checkpoint
    # 3 sequences: 3 snapshot rows, so that the follow-up's own snapshot leaves the first prompt's in place
    options = dict(progress=False, dtype="float32", block_size=16, max_num_batched_tokens=64, max_num_seqs=3)
    on, off = LLM(str(folder), prefix_cache=True, **options), LLM(str(folder), prefix_cache=False, **options)
    first = prompts(11, (100,))[0]
    answer = on.generate(first, GREEDY)[0]
    assert answer.token_ids == hf_greedy(hf, first)  # 100 prompt tokens: chunks end at 64 (a snapshot) and 100
    follow_up = first + answer.token_ids + prompts(12, (9,))[0]
    branch = first[:90] + prompts(13, (12,))[0]  # shares 90 tokens with the first prompt: 5 whole blocks
    for prompt, cached in ((follow_up, (len(first) + NEW - 1) // 16 * 16), (branch, 64)):
        out = on.generate(prompt, GREEDY)[0]
        assert out.cached_tokens == cached
        assert out.token_ids == off.generate(prompt, GREEDY)[0].token_ids == hf_greedy(hf, prompt)
    states = on.engine.states
    assert states.restored == 2 and states.num_snapshots == 3
    assert sorted(states.free) == list(range(states.num_slots))
    assert on.engine.kv.num_free == on.engine.kv.num_blocks


def test_state_snapshots_keep_what_is_owned_and_evict_the_least_recent(next_checkpoint) -> None:
    """The snapshot rows against a plain-Python model of them: a row a running sequence owns is never given up; rows
    nobody owns go least recently used first; a prefix saved twice keeps the newer copy; restore copies the bytes."""
    folder, _ = next_checkpoint
    model = LLM(str(folder), progress=False, dtype="float32").engine.model
    from edgemoe.engine.state_cache import StateCache

    states = StateCache(model, 2, torch.float32, torch.device("cpu"), snapshots=3)
    a, b = states.allocate(), states.allocate()  # (cleared: then random states in every row)
    g = torch.Generator().manual_seed(1)
    states.pool.copy_(torch.randint(0, 256, states.pool.shape, generator=g, dtype=torch.uint8))
    seq_a, seq_b = states.pool[a].clone(), states.pool[b].clone()
    ra = states.save(a, key=101, row=None)
    rb = states.save(b, key=102, row=None)
    assert states.has(101) and states.has(102) and ra != rb
    states.disown(ra)  # a ended: 101 stays findable
    rc = states.save(b, key=103, row=None)  # the last free row
    assert {ra, rb, rc} == set(range(3, 6))
    states.disown(rb)
    states.disown(rc)
    states.restore(101, a)  # 101 is now the most recently used: 102 goes first
    assert torch.equal(states.pool[a], seq_a)
    rd = states.save(b, key=104, row=None)
    assert rd == rb and not states.has(102) and states.has(101) and states.has(103)
    re_ = states.save(a, key=103, row=rd)  # the owned row re-keyed; 103's older copy freed
    assert re_ == rd and states.row_at[103] == rd and not states.has(104)
    states.restore(103, b)
    assert torch.equal(states.pool[b], seq_a)  # a's state, saved under 103 last
    assert not torch.equal(seq_a, seq_b)


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), r"layer_types\[3\] is 'sl"),
        (lambda c: c.update(layer_types=["linear_attention"] * 3), "layer_types has 3 entries for 4 layers"),
        (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of"),
    ],
)
def test_bad_config_is_one_line(next_checkpoint, tmp_path, change, message) -> None:
    folder, _ = next_checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    config = _config(folder)
    change(config)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgeMoEError, match=message) as err:
        LLM(str(bad), progress=False)
    assert "\n" not in str(err.value)


def test_missing_state_tensor_is_one_line(next_checkpoint, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = next_checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).symlink_to(f)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EdgeMoEError, match=r"lacks 1 tensors, e\.g\. model\.layers\.2\.self_attn\.A\b"):
        LLM(str(bad), progress=False)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_make_model_writes_what_transformers_and_edgemoe_read_alike(tmp_path, family: str) -> None:
    """A random checkpoint of each hybrid family (`edgemoe make-model`): transformers loads it as the family's own
    class with every tensor in place (none missing, none unused), both greedy-decode the same tokens, and the tiny
    geometry keeps a full-attention layer among its three."""
    from transformers import AutoModelForCausalLM

    from edgemoe.tools.make_model import make_model

    folder = make_model(tmp_path / family, family, "tiny", dtype="float32")
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf).__name__ == ("Qwen3NextForCausalLM" if family == "qwen3_next" else "Qwen3_5MoeForCausalLM")
    assert hf.config.layer_types == ["linear_attention", "linear_attention", "full_attention"]
    llm = LLM(str(folder), progress=False, dtype="float32")
    prompt = [11, 200, 3000, 45, 7]
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    ref = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == ref and len(set(ours)) > 3


@pytest.mark.parametrize("case", ["qwen3next-dense", "qwen35-tied-mha"])
def test_joined_input_projections_decode_as_transformers(tiny_checkpoint, case: str) -> None:
    """Decode's input projections joined into one weight (`GatedDeltaNet.join_projections`, what a CUDA engine does
    when it chooses kernels), here on the CPU: the projections' weights are views of the joined one, and greedy
    tokens still equal transformers' (Qwen3-Next's b and a in one projection, Qwen3.5's apart)."""
    from edgemoe.layers.linear_attention import GatedDeltaNet

    folder, hf = tiny_checkpoint(case, "per-expert")
    llm = LLM(str(folder), progress=False, dtype="float32")
    mixers = [m for m in llm.engine.model.modules() if isinstance(m, GatedDeltaNet)]
    assert mixers and all(m.join_projections() for m in mixers)
    for m in mixers:
        joined = m._joined[0].weight
        parts = [m.in_proj_qkv, m.in_proj_z, *m._ba_projections()]
        assert sum(p.weight.shape[0] for p in parts) == joined.shape[0]
        assert all(p.weight.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr() for p in parts)
    calls = []
    for m in mixers:  # count the joined projection's calls: decode steps must run it, not the four apart
        joined = m._joined[0]
        joined.forward = lambda x, f=joined.forward: (calls.append(x.shape[0]), f(x))[1]
    batch = prompts(4)
    outs = llm.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p) for p in batch]
    assert len(calls) >= len(mixers) * (NEW - 1)  # every decode step, every linear-attention layer
