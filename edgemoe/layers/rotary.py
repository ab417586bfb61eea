from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE with a precomputed cos/sin table, rotate-half convention."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def inv_freq(self) -> torch.Tensor:
        """[head_dim / 2] rotation frequencies; a subclass changes them (Gemma-4's proportional RoPE)."""
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))

    def build(self, device: torch.device | str) -> None:
        """(Re)compute the table; called after weights are materialised on their device."""
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), self.inv_freq())
        emb = torch.cat((freqs, freqs), dim=-1)  # [positions, head_dim]
        self.cos_sin = torch.stack((emb.cos(), emb.sin())).to(device)  # [2, positions, head_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. CUDA runs this inside one kernel with the
        # q/k norm and the KV-cache write (`edgemoe.kernels.norm_rope.attention_prologue`); this is its reference
        cos, sin = self.cos_sin[:, positions].to(q.dtype).unsqueeze(2)  # [tokens, 1, head_dim] each
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PartialRotary(RotaryEmbedding):
    """RoPE on the first `rotary_dim` of each head's dims only (rotate-half within them), the rest passed through:
    Qwen3-Next's and Qwen3.5's partial rotary. The fused attention prologue rotates whole heads, so a layer with this
    one keeps the plain-torch prologue."""

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int, theta: float) -> None:
        super().__init__(rotary_dim, max_positions, theta)
        self.rotary_dim = rotary_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        q_rot, k_rot = super().forward(positions, q[..., :r], k[..., :r])
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
