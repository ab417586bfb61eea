"""A multi-token-prediction (MTP) head: the layers some checkpoints carry after the decoder to predict the token after
next (Qwen3-Next and Qwen3.5 / 3.6 MoE: `mtp.*`), which speculative decoding drafts with (`edgemoe.engine.mtp`).

At position i the head reads the decoder's final hidden state h_i (after its final norm: what the lm_head reads) and
the embedding of the token after it, t_{i+1}; each is normalised, the two joined [embedding, hidden] and projected
back to the hidden size (`fc`), then one decoder layer (full attention over the head's own KV cache, routed experts)
and the head's final norm; the model's lm_head on that predicts t_{i+2}. Drafting k tokens chains it: the head's
output at i stands in for h_{i+1}, beside the token it predicted.

The head's layers are the family's decoder layers, kept in the decoder's `layers` after the decoder's own
(`ModelConfig.mtp_layers`; the decoder's loop stops before them), so that the KV cache, the expert cache and the
loader treat them as any layer: the head's experts come through the same cache as the decoder's. Chained step s
uses layer s mod mtp_layers (the released checkpoints have one).
"""

from __future__ import annotations

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.layers.linear import DecodeLinear
from edgemoe.layers.norm import RMSNorm


class MTPHead(nn.Module):
    """The head's own weights (Qwen3-Next's names under `mtp.`; a family whose checkpoints name them otherwise maps
    them in its `checkpoint_name`); its layers are `decoder.layers[first:]`. A family's subclass may set `own_vocab`
    (the head reads its own token embedding and lm_head, `embed_tokens` and `head`, which GLM-4.5's checkpoints carry
    with it) and `mask_first` (position 0's embedding zeroed, as vLLM's GLM-4.5 head does)."""

    own_vocab = False
    mask_first = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.first, self.count = cfg.decoder_layers, cfg.mtp_layers
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = DecodeLinear(2 * H, H, bias=False)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if self.own_vocab:  # _weight: no random init (see `DecoderModel`)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H, _weight=torch.empty(cfg.vocab_size, H))
            self.head = DecodeLinear(H, cfg.vocab_size, bias=False)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The head's output rows (`forward`'s) -> logits [rows, vocab] (float32): the model's lm_head, or its own."""
        return self.head(x).float() if self.own_vocab else model.logits(x)

    def forward(
        self, decoder: nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, step: int = 0
    ) -> torch.Tensor:
        """hidden [tokens, H] (the decoder's final hidden states, or the head's own output for a chained step),
        next_ids [tokens] (the token after each position), positions [tokens] -> the head's hidden states [tokens, H],
        normalised (the lm_head's input). Runs in the forward context its caller set (the head layer's KV slots)."""
        embedded = (self.embed_tokens if self.own_vocab else decoder.embed_tokens)(next_ids)
        if self.mask_first:
            embedded = embedded.masked_fill((positions == 0)[:, None], 0)
        embedded = self.pre_fc_norm_embedding(embedded)
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = decoder.layers[self.first + step % self.count](x, positions, None)
        x, _ = self.norm(x, residual)
        return x
