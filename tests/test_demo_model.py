"""The bundled demo model: shipped files load, agree with transformers, and generate token-identically."""

from __future__ import annotations

import json

from edgemoe import SamplingParams, demo_model_path
from edgemoe.models.registry import read_config

TEXTS = [
    "ROMEO.\nBut soft, what light",
    "Of Man's first disobedience, and the Fruit",
    "  spaces,\ttabs\n\nand unicode: é, ü, 日本, 🎭 — 'quotes'",
    "",
]


def test_shipped_files_present() -> None:
    folder = demo_model_path()
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_log.json",
        "routing_stats.json",
    ):
        assert (folder / name).is_file(), name
    assert (folder / "model.safetensors").stat().st_size <= 30_000_000
    log = json.loads((folder / "training_log.json").read_text())
    assert log["held_out_bpb"] <= 2.0
    assert log["held_out_lines_in_training"] == 0


def test_config_agrees_with_transformers() -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(demo_model_path())
    cfg, _ = read_config(demo_model_path())
    assert hf.model_type == cfg.model_type == "qwen2_moe"
    assert (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers) == (cfg.vocab_size, cfg.hidden_size, cfg.num_layers)
    assert (hf.num_experts, hf.num_experts_per_tok) == (cfg.num_experts, cfg.top_k)
    assert cfg.num_experts >= 16 and cfg.top_k >= 2 and cfg.shared_expert_intermediate_size > 0
    assert hf.shared_expert_intermediate_size == cfg.shared_expert_intermediate_size
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta


def test_tokenizer_round_trip_matches_transformers(demo_llm, demo_hf) -> None:
    _, hf_tok = demo_hf
    for text in TEXTS:
        ids = demo_llm.tokenizer.encode(text)
        assert ids == hf_tok(text).input_ids
        assert demo_llm.tokenizer.decode(ids) == hf_tok.decode(ids) == text
    messages = [
        {"role": "user", "content": "What news?"},
        {"role": "assistant", "content": "None."},
        {"role": "user", "content": "Speak!"},
    ]
    ours = demo_llm.tokenizer.apply_chat_template(messages)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_demo_greedy_matches_transformers(demo_llm, demo_hf) -> None:
    hf, hf_tok = demo_hf
    prompts = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be, that is the question:\nWhether"]
    outs = demo_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    for prompt, out in zip(prompts, outs):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out.token_ids == ref
        assert out.text == hf_tok.decode(ref, skip_special_tokens=True)
    assert sum(len(o.token_ids) for o in outs) >= 96  # the comparison covered real length


def test_demo_chat_matches_transformers(demo_llm, demo_hf) -> None:
    hf, hf_tok = demo_hf
    messages = [{"role": "user", "content": "What news from the court, my lord?"}]
    out = demo_llm.chat(messages, SamplingParams(max_tokens=40, temperature=0))[0]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    ref = hf.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "stop" and out.text and "<|im_end|>" not in out.text


def test_sampling_seeds(demo_llm) -> None:
    def text(seed: int) -> str:
        return demo_llm.generate("The king", SamplingParams(max_tokens=24, temperature=0.9, seed=seed))[0].text

    assert text(1) == text(1)
    assert len({text(s) for s in (1, 2, 3)}) == 3


def test_seeded_request_independent_of_batch(demo_llm) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    alone = demo_llm.generate("HAMLET.\n", params)[0].token_ids
    batched = demo_llm.generate(["Once more", "HAMLET.\n", "My lord,"], params)[1].token_ids
    assert alone == batched
