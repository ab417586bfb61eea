"""The per-batch forward context: what layers need to know about the batch, set by the ModelRunner.

Layers read it with `get_context()` instead of seeing scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [tokens] KV slot each new token writes
    context_lens: torch.Tensor  # [seqs] tokens in the KV cache after this step, per sequence
    block_tables: torch.Tensor  # [seqs, max_blocks] KV block ids, padded with 0
    # prefill only (host lists: prefill may synchronise freely)
    query_lens: list[int] | None = None  # new tokens per sequence
    context_lens_host: list[int] | None = None
    # CUDA-graph decode only: [seqs] False on padding rows (their experts are not fetched or counted)
    valid: torch.Tensor | None = None
    # the routing seam (`SparseMoE.routed`): ids given from outside replace the router's choice (a routing trace,
    # `edgemoe bench`), and each MoE layer's routed ids are written out (`--record-routing`); [moe_layers, seqs, top_k]
    forced_ids: torch.Tensor | None = None
    routed_ids: torch.Tensor | None = None
    # [seqs] each sequence's slot in the state cache (`edgemoe.engine.state_cache`), for layers that keep a state
    state_slots: torch.Tensor | None = None


_CONTEXT: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: the model runs only inside ModelRunner")
    return _CONTEXT
