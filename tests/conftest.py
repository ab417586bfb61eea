"""Shared fixtures: tiny random checkpoints written by transformers' own classes (the oracle)."""

from __future__ import annotations

import math
import os
import shutil
import zlib
from pathlib import Path

import pytest

# Before torch loads OpenMP (and inherited by the CLI and server subprocesses): OpenMP's threads wait for work by
# spinning, which on a busy 2-core machine (CI beside other jobs) makes each parallel region wait for a descheduled
# spinner; tests/engine/test_scheduler.py + tests/test_demo_model.py took 260 s beside other work, 16 s with passive
# waits (docs/findings.md, "OpenMP on a busy machine"). Results do not depend on how threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Without CUDA the Triton kernels run under Triton's interpreter (numpy). The variable must be set before `triton.jit`
# decorates them, i.e. before any edgemoe.kernels module is imported by any test module: here, the first conftest.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from edgemoe import demo_model_path  # noqa: E402


def _interpreter_dot_reads_bfloat16() -> None:
    """Triton's interpreter keeps bfloat16 as its bits (uint16) and its `tl.dot` multiplies those integers; widen
    them to float32 first, which is exact, so a bf16 dot accumulates in fp32 as the GPU's does."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    create_dot = InterpreterBuilder.create_dot

    def widened(x: TensorHandle) -> TensorHandle:
        if x.dtype.scalar != tl.bfloat16:
            return x
        return TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202 - the builder's
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = dot


if not torch.cuda.is_available():
    _interpreter_dot_reads_bfloat16()

VOCAB = 6144  # the demo tokenizer's vocabulary, so that text prompts work on tiny models too

# id -> (family, config overrides). Shapes cover GQA/MQA/MHA, explicit head_dim, norm_topk_prob on/off,
# shared expert on/off, dense layers between MoE layers, tied and untied embeddings.
TINY = {
    "qwen2-gqa-shared-dense": (
        "qwen2_moe",
        dict(num_key_value_heads=2, shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False),
    ),
    "qwen2-mqa-tied-step2": (
        "qwen2_moe",
        dict(
            num_key_value_heads=1,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=2,
            num_hidden_layers=4,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2-no-shared": ("qwen2_moe", dict(num_key_value_heads=2, shared_expert_intermediate_size=0)),
    "qwen3-head-dim": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=32, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3-mqa-tied": ("qwen3_moe", dict(num_key_value_heads=1, norm_topk_prob=False, tie_word_embeddings=True)),
    "mixtral-gqa": ("mixtral", dict(num_key_value_heads=2)),
    "olmoe-mha-clip": ("olmoe", dict(num_key_value_heads=4, clip_qkv=4.0)),
    # hybrid: 3 Gated DeltaNet layers to 1 gated full-attention layer; grouped value heads (4 per 2 key heads)
    "qwen3next-dense": ("qwen3_next", dict(mlp_only_layers=[1], attention_bias=True)),
    "qwen35-tied-mha": ("qwen3_5_moe_text", dict(linear_num_key_heads=4, tie_word_embeddings=True)),
    # sigmoid routing: 4 groups of 4 experts, the best 2 in play; a dense first layer; q/k norm; q/k/v bias; an MTP
    # layer in the checkpoint (skipped)
    "glm-groups-qknorm-mtp": (
        "glm4_moe",
        dict(
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            use_qk_norm=True,
            attention_bias=True,
            num_nextn_predict_layers=1,
        ),
    ),
    # GLM-4.5-Air's kind: one group, two dense layers, no q/k norm nor bias, no top-k renormalisation, 2 shared
    # experts' width, a quarter of each head rotated, no MTP layer
    "glm-air-dense2": (
        "glm4_moe",
        dict(
            first_k_dense_replace=2,
            num_hidden_layers=4,
            norm_topk_prob=False,
            n_shared_experts=2,
            partial_rotary_factor=0.25,
            num_nextn_predict_layers=0,
        ),
    ),
    # gpt-oss: sliding (a window of 8, shorter than the prompts) and full layers, sinks, YaRN, biased router and
    # experts; experts as float weights here (MXFP4 ones: tests/models/test_gpt_oss.py)
    "gpt-oss-yarn-window": ("gpt_oss", dict(sliding_window=8)),
}
# transformers' (config, model) classes where they are not f"{Prefix}Config" / f"{Prefix}ForCausalLM"
_HF_CLASSES = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
# gpt-oss's YaRN, scaled down: a factor of 8 over 64 original positions, so that the tests' positions reach past them
TINY_YARN = dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                 original_max_position_embeddings=64, rope_theta=10000.0)  # fmt: skip


def hf_model(family: str, **overrides):
    """A transformers model of `family` with small shapes and weights scaled so outputs are not flat."""
    import transformers

    config_class, model_class = _HF_CLASSES[family]
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family in ("qwen2_moe", "qwen3_moe"):
        base.update(num_experts=8, moe_intermediate_size=32)
    elif family in ("qwen3_next", "qwen3_5_moe_text"):
        base.update(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8)  # fmt: skip
    elif family == "glm4_moe":
        base.update(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, head_dim=32)
    elif family == "gpt_oss":  # expert rows in whole MXFP4 blocks (32)
        base.update(num_local_experts=8, intermediate_size=64, head_dim=16, rope_parameters=TINY_YARN)
    elif family == "mixtral":
        base.update(num_local_experts=8, intermediate_size=32)
    else:
        base.update(num_experts=8, intermediate_size=32)
    base.update(overrides)
    config = getattr(transformers, config_class)(**base)
    torch.manual_seed(zlib.crc32(repr(sorted(overrides.items())).encode()))  # stable across processes
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:  # small: otherwise tied models just echo their input token
                p.copy_(0.1 * torch.randn_like(p))
            elif p.numel():
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():  # a learnt buffer: GLM's routing bias, which transformers zeroes
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def save_checkpoint(model, folder: Path, layout: str) -> Path:
    """per-expert: transformers' save_pretrained (Hub layout); fused: the raw state dict (transformers >= 5)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if layout == "per-expert":
        model.save_pretrained(folder)
    else:
        model.config.save_pretrained(folder)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / name, folder / name)
    if getattr(model.config, "num_nextn_predict_layers", 0):
        add_mtp_layers(model, folder)
    return folder


def add_mtp_layers(model, folder: Path) -> None:
    """GLM-4.5's next-token-prediction layers, numbered after the decoder's, into the checkpoint as the Hub's carry
    them (transformers builds none): a decoder layer's tensors plus the MTP block's own (random values)."""
    from safetensors.torch import load_file, save_file

    cfg, path = model.config, folder / "model.safetensors"
    state, last = load_file(str(path)), cfg.num_hidden_layers - 1
    H, g = cfg.hidden_size, torch.Generator().manual_seed(1)
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        layer = {
            k.replace(f".layers.{last}.", f".layers.{i}."): v.clone()
            for k, v in state.items()
            if f".layers.{last}." in k
        }
        extra = {"eh_proj.weight": (H, 2 * H), "enorm.weight": (H,), "hnorm.weight": (H,),
                 "embed_tokens.weight": (cfg.vocab_size, H), "shared_head.norm.weight": (H,),
                 "shared_head.head.weight": (cfg.vocab_size, H)}  # fmt: skip
        layer |= {f"model.layers.{i}.{k}": torch.randn(shape, generator=g) for k, shape in extra.items()}
        state |= layer
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: (case id, layout) -> (folder, transformers model); built once per session."""
    cache: dict = {}

    def get(case: str, layout: str):
        if (case, layout) not in cache:
            family, overrides = TINY[case]
            model = hf_model(family, **overrides)
            folder = save_checkpoint(model, tmp_path_factory.mktemp(f"{case}-{layout}"), layout)
            cache[case, layout] = (folder, model)
        return cache[case, layout]

    return get


@pytest.fixture(scope="session")
def demo_llm():
    from edgemoe import LLM

    return LLM(progress=False, dtype="float32")  # compared with transformers in float32


@pytest.fixture(scope="session")
def demo_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_model_path())
