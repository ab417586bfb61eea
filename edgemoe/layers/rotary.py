from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE with a precomputed cos/sin table, rotate-half convention.

    Partial rotary (`rotary_dim` < head_dim: GLM-4.5, Qwen3-Next) turns the leading `rotary_dim` dims of each head,
    halves paired within them, and passes the rest through, as transformers' `apply_rotary_pos_emb` does. The table
    is still [2, positions, head_dim], its pass-through dims cos 1 and sin 0, so that the fused prologue kernel reads
    one row shape whatever the family (x * 1 + y * 0 is x exactly)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.rotary_dim = rotary_dim or head_dim
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def inv_freq(self) -> torch.Tensor:
        """[rotary_dim / 2] rotation frequencies; a subclass changes them (Gemma-4's proportional RoPE)."""
        rot = self.rotary_dim
        return 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))

    def build(self, device: torch.device | str) -> None:
        """(Re)compute the table; called after weights are materialised on their device."""
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), self.inv_freq())
        emb = torch.cat((freqs, freqs), dim=-1)  # [positions, rotary_dim]
        rest = self.head_dim - emb.shape[-1]  # pass-through dims: cos 1, sin 0
        cos, sin = (torch.nn.functional.pad(f, (0, rest), value=v) for f, v in ((emb.cos(), 1.0), (emb.sin(), 0.0)))
        self.cos_sin = torch.stack((cos, sin)).to(device)  # [2, positions, head_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. CUDA runs this inside one kernel with the
        # q/k norm and the KV-cache write (`edgemoe.kernels.norm_rope.attention_prologue`); this is its reference
        rot = self.rotary_dim
        cos, sin = self.cos_sin[:, positions, :rot].to(q.dtype).unsqueeze(2)  # [tokens, 1, rotary_dim] each
        if rot == self.head_dim:
            return _turn(q, cos, sin), _turn(k, cos, sin)
        return tuple(torch.cat((_turn(x[..., :rot], cos, sin), x[..., rot:]), dim=-1) for x in (q, k))


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
