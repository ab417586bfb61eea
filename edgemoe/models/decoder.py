"""The decoder every supported family shares: pre-norm attention + (sparse MoE | dense MLP) blocks.

Families differ only in config flags (qkv bias, q/k norm, shared expert, dense layers) and in
checkpoint names, which their own files handle. Module names follow Hugging Face, so the loader is a
small renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.engine.context import get_context
from edgemoe.layers.attention import PagedAttention
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.mlp import GatedMLP
from edgemoe.layers.norm import RMSNorm
from edgemoe.layers.rotary import RotaryEmbedding
from edgemoe.moe.layer import SparseMoE


def qkv_sizes(cfg: ModelConfig) -> list[int]:
    """Rows of the checkpoint's q_proj, k_proj and v_proj: the row blocks of our fused qkv_proj, in that order."""
    return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, block_size: int) -> None:
        super().__init__()
        h, d, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.nq, self.nkv, self.d, self.clip = nq, nkv, d, cfg.clip_qkv
        # q, k and v as one GEMM (decode reads one weight in one launch, not three small ones); the loader fills
        # its row blocks from the checkpoint's q_proj, k_proj and v_proj
        self.qkv_proj = DecodeLinear(h, (nq + 2 * nkv) * d, bias=cfg.qkv_bias)
        self.qkv_sizes = qkv_sizes(cfg)
        self.o_proj = DecodeLinear(nq * d, h, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(nq * d, cfg.rms_norm_eps), RMSNorm(nkv * d, cfg.rms_norm_eps)
        self.rotary = [rotary]  # shared, and kept out of this module's parameters
        self.attn = PagedAttention(nq, nkv, d, block_size)

    def forward(self, x: torch.Tensor | None, positions: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """x: [tokens, hidden] (normed); `qkv`: x's projection, already made (`add_norm_forward`; x is then None)."""
        qkv = self.qkv_proj(x) if qkv is None else qkv
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)  # [tokens, heads * head_dim], row-strided views
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(-1, self.nq, self.d), k.view(-1, self.nkv, self.d), v.view(-1, self.nkv, self.d)
        if q.is_cuda:
            return self.o_proj(self.attn.attend(self._prologue(q, k, v, positions)))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v))

    def fuses_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> bool:
        """Whether `add_norm_forward` runs `norm` inside the qkv GEMV: one token on a CUDA device without PDL (where
        `DecodeLinear` runs the GEMV), one dtype throughout, a row that `norm_gemv` holds.

        Only without PDL (GPUs before Hopper, such as the Ada and Ampere cards our users own): measured on an H200
        (qwen3-30b-a3b resident, 4K, graphs), the fusion gains 1.6 % with PDL off (337.8 -> 343.1 tok/s) but loses
        with it: 384 -> 357 tok/s when the fused GEMV's 640 programs are scheduled during the MoE down kernel
        (a one-program norm kernel sat there before), 383 with an ordinary launch (benchmarks/RESULTS.md)."""
        tensors = (x, residual, norm.weight, self.qkv_proj.weight)
        if not x.is_cuda or x.dim() != 2 or x.shape[0] != 1 or len({t.dtype for t in tensors}) > 1:
            return False
        from edgemoe.kernels.dense_gemv import MAX_NORM_HIDDEN  # CPU-only machines lack triton
        from edgemoe.kernels.pdl import use_pdl

        return x.shape[1] <= MAX_NORM_HIDDEN and not use_pdl(x.device)

    def add_norm_forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(norm(x, residual), positions)` with the residual add and the norm inside the qkv GEMV (where
        `fuses_norm`): one launch fewer -> (attention output, x + residual)."""
        from edgemoe.kernels.dense_gemv import norm_gemv

        qkv, h = norm_gemv(x, residual, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias)
        return self(None, positions, qkv), h

    def _prologue(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The CPU path's per-head q/k norm, rotary and KV-cache write as one launch instead of up to five (the
        "full" norm and the clip ran before, on [tokens, heads * head_dim]) -> rotated q."""
        from edgemoe.kernels.norm_rope import attention_prologue  # CPU-only machines lack triton

        norms = (
            (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm == "head" else (None, None, 0.0)
        )
        cache = (self.attn.k_cache, self.attn.v_cache, get_context().slot_mapping)
        return attention_prologue(q, k, v, positions, self.rotary[0].cos_sin, *cache, *norms)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, block_size: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, rotary, block_size)
        self.is_moe = cfg.moe_layers[layer]
        self.mlp = SparseMoE(cfg) if self.is_moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block carrying the residual: `x` is the previous block's output and `residual` the hidden state
        it adds to (None at the first layer, whose x is the embedding). Each add happens in the next norm (one
        launch on CUDA; in decode the MoE router's gate GEMV runs the second, and on GPUs without PDL the qkv GEMV
        the first), so this returns (mlp output, hidden state before it): their sum is the layer's output."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
            x = self.self_attn(x, positions)
        elif self.self_attn.fuses_norm(x, residual, self.input_layernorm):  # decode on CUDA without PDL
            x, residual = self.self_attn.add_norm_forward(x, residual, self.input_layernorm, positions)
        else:
            x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(x, positions)
        if self.is_moe and self.mlp.fuses_norm(x, self.post_attention_layernorm):  # decode on CUDA
            return self.mlp.add_norm_forward(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        # _weight skips Embedding's random init, which on the meta device pulls in torch._dynamo (~1 s)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, block_size) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [tokens, hidden]
        for layer in self.layers:
            x, residual = layer(x, positions, residual)
        x, _ = self.norm(x, residual)
        return x


class MoEForCausalLM(nn.Module):
    """Token ids + positions of a flattened batch -> final hidden states; `logits` on chosen rows."""

    def __init__(self, cfg: ModelConfig, block_size: int = 16) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, block_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
