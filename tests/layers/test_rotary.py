"""RoPE against transformers' (float32): whole heads as Qwen3-MoE's rotary turns them, and partial rotary as
GLM-4.5's does (the leading dims of each head, halves paired within them, the rest passed through)."""

from __future__ import annotations

import pytest
import torch

from edgemoe.layers.rotary import RotaryEmbedding


def transformers_rotary(
    model_type: str, head_dim: int, partial: float, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [tokens, heads, head_dim] turned by transformers' own rotary embedding and `apply_rotary_pos_emb`."""
    from transformers import Glm4MoeConfig, Qwen3MoeConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as glm
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen

    if model_type == "glm4_moe":
        config = Glm4MoeConfig(head_dim=head_dim, partial_rotary_factor=partial, rope_theta=1e6)
        module, rotary = glm, glm.Glm4MoeRotaryEmbedding(config)
    else:
        module, rotary = qwen, qwen.Qwen3MoeRotaryEmbedding(Qwen3MoeConfig(head_dim=head_dim, rope_theta=1e6))
    cos, sin = rotary(q, positions[None])
    q2, k2 = module.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q2[0].transpose(0, 1), k2[0].transpose(0, 1)


@pytest.mark.parametrize("model_type,partial", [("qwen3_moe", 1.0), ("glm4_moe", 0.5), ("glm4_moe", 0.25)])
def test_rotary_matches_transformers(model_type: str, partial: float) -> None:
    head_dim, tokens = 64, 9
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(tokens, 4, head_dim, generator=g), torch.randn(tokens, 2, head_dim, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 3, 3, 40])
    ours = RotaryEmbedding(head_dim, 512, 1e6, int(head_dim * partial))
    ours.build("cpu")
    q1, k1 = ours(positions, q, k)
    q2, k2 = transformers_rotary(model_type, head_dim, partial, q, k, positions)
    torch.testing.assert_close(q1, q2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
    rot = int(head_dim * partial)
    assert torch.equal(q1[..., rot:], q[..., rot:]) and torch.equal(k1[..., rot:], k[..., rot:])


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(truncate: bool) -> None:
    """gpt-oss's YaRN (factor 32 over 4096 original positions, theta 150000): the frequencies bit for bit, and q, k
    turned as transformers' `GptOssRotaryEmbedding` (cos and sin scaled by its attention factor) turns them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss import modeling_gpt_oss as oss

    from edgemoe.layers.rotary import YarnRotaryEmbedding

    head_dim, tokens = 64, 9
    rope = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                original_max_position_embeddings=4096, rope_theta=150000.0)  # fmt: skip
    rotary = oss.GptOssRotaryEmbedding(GptOssConfig(head_dim=head_dim, rope_parameters=rope))
    ours = YarnRotaryEmbedding(head_dim, 8192, 150000.0, 32.0, 4096, 32.0, 1.0, truncate)
    assert torch.equal(ours.inv_freq(), rotary.inv_freq) and ours.attention_scaling == rotary.attention_scaling
    ours.build("cpu")
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(tokens, 4, head_dim, generator=g), torch.randn(tokens, 2, head_dim, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 8191, 40])
    cos, sin = rotary(q, positions[None])
    q2, k2 = oss.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q1, k1 = ours(positions, q, k)
    torch.testing.assert_close(q1, q2[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k1, k2[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(q1.norm(dim=-1), q.norm(dim=-1))  # the attention factor scaled them
