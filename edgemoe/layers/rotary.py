from __future__ import annotations

import math

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
        self.attention_scaling = 1.0  # cos and sin scaled by it (YaRN's); pass-through dims stay 1 and 0
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
        scaled = ((emb.cos() * self.attention_scaling, 1.0), (emb.sin() * self.attention_scaling, 0.0))
        cos, sin = (torch.nn.functional.pad(f, (0, rest), value=v) for f, v in scaled)
        self.cos_sin = torch.stack((cos, sin)).to(device)  # [2, positions, head_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. CUDA runs this inside one kernel with the
        # q/k norm and the KV-cache write (`edgemoe.kernels.norm_rope.attention_prologue`); this is its reference
        rot = self.rotary_dim
        cos, sin = self.cos_sin[:, positions, :rot].to(q.dtype).unsqueeze(2)  # [tokens, 1, rotary_dim] each
        if rot == self.head_dim:
            return _turn(q, cos, sin), _turn(k, cos, sin)
        return tuple(torch.cat((_turn(x[..., :rot], cos, sin), x[..., rot:]), dim=-1) for x in (q, k))


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN (transformers' `rope_type` "yarn"): frequencies whose wavelength fits `original_max` positions many times
    (more than `beta_fast` turns) kept, those that turn fewer than `beta_slow` times divided by `factor`, a linear ramp
    between; cos and sin scaled by 0.1 ln(factor) + 1 unless `attention_factor` says otherwise. `truncate`: the ramp's
    ends rounded outwards to whole dims."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, factor: float, original_max: int,
        beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True, attention_factor: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(head_dim, max_positions, theta)
        self.factor, self.original_max, self.betas, self.truncate = (
            factor,
            original_max,
            (beta_fast, beta_slow),
            truncate,
        )
        default = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        self.attention_scaling = default if attention_factor is None else attention_factor

    def _dim_of(self, turns: float) -> float:
        """The (fractional) dim whose frequency turns `turns` times over the original context."""
        rot = self.rotary_dim
        return rot * math.log(self.original_max / (turns * 2 * math.pi)) / (2 * math.log(self.theta))

    def inv_freq(self) -> torch.Tensor:
        rot = self.rotary_dim
        low, high = (self._dim_of(b) for b in self.betas)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot - 1)
        high = high + 0.001 if low == high else high  # no zero-width ramp
        base = self.theta ** (torch.arange(0, rot, 2).float() / rot)  # [rot / 2]
        ramp = ((torch.arange(rot // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        kept = 1 - ramp  # 1: extrapolated (the frequency kept), 0: interpolated (divided by factor)
        return 1.0 / (self.factor * base) * (1 - kept) + 1.0 / base * kept


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
