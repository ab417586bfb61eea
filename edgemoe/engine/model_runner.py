"""Runs one scheduled batch through the model: builds the inputs and forward context, computes logits
for the sequences that are due a token, samples. The sampled ids are the only host read of a step."""

from __future__ import annotations

import torch

from edgemoe.engine.context import ForwardContext, set_context
from edgemoe.engine.cuda_graphs import DecodeGraphs
from edgemoe.engine.kv_cache import KVCache
from edgemoe.engine.sampler import Sampler
from edgemoe.engine.scheduler import Batch
from edgemoe.models.decoder import MoEForCausalLM


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, kv: KVCache, device: torch.device) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # set by the engine once captured (CUDA)
        kv.bind([layer.self_attn.attn for layer in model.model.layers])

    def _tensor(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host list -> device tensor without a host synchronisation: pinned staging, async copy. The staging
        buffer cannot be reused too early: the step's sampled-id read waits for everything before it."""
        host = torch.tensor(data, dtype=dtype)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def host_inputs(self, batch: Batch) -> tuple[list[int], list[int], list[int], list[int]]:
        """Token ids, positions and KV slots of the tokens computed this step; context length per sequence."""
        bs = self.kv.block_size
        ids, positions, slots, context_lens = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new):
            start = seq.num_computed
            ids += seq.token_ids[start : start + n]
            for p in range(start, start + n):
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            context_lens.append(start + n)
        return ids, positions, slots, context_lens

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        ids, positions, slots, context_lens = self.host_inputs(batch)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [self.kv.pad_block] * (width - len(s.block_table)) for s in batch.seqs]
        ctx = ForwardContext(
            is_prefill=batch.is_prefill,
            slot_mapping=self._tensor(slots),
            context_lens=self._tensor(context_lens),
            block_tables=self._tensor(tables),
            query_lens=list(batch.num_new) if batch.is_prefill else None,
            context_lens_host=context_lens if batch.is_prefill else None,
        )
        return self._tensor(ids), self._tensor(positions), ctx

    @torch.inference_mode()
    def compute_logits(self, batch: Batch) -> tuple[list[int], torch.Tensor | None]:
        """Run the batch; return the indices of sequences due a token and their logits [due, vocab] (float32).

        A sequence is due when this step computes its last uncached token (a prefill chunk that does not
        end its prompt is not). Decode batches replay a captured CUDA graph when there is one of their size."""
        if not batch.is_prefill and self.graphs is not None and self.graphs.size_for(len(batch.seqs)):
            tables = [s.block_table for s in batch.seqs]
            return list(range(len(batch.seqs))), self.graphs.replay(*self.host_inputs(batch), tables)
        input_ids, positions, ctx = self.prepare(batch)
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            set_context(None)
        due = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new)) if s.num_computed + n == len(s.token_ids)]
        if not due:
            return due, None
        ends = [sum(batch.num_new[: i + 1]) - 1 for i in due]
        return due, self.model.logits(hidden[self._tensor(ends)])

    def run(self, batch: Batch) -> list[int | None]:
        """Next token per sequence of the batch; None for a prefill chunk that does not end its prompt."""
        due, logits = self.compute_logits(batch)
        out: list[int | None] = [None] * len(batch.seqs)
        if not due:
            return out
        seqs = [batch.seqs[i] for i in due]
        params = [s.params for s in seqs]
        tokens = self.sampler(
            logits,
            self._tensor([p.temperature for p in params], torch.float32),
            self._tensor([p.top_k for p in params]),
            self._tensor([p.top_p for p in params], torch.float32),
            self._tensor([p.min_p for p in params], torch.float32),
            [None if p.greedy else s.generator for p, s in zip(params, seqs)],
        ).tolist()  # the step's one host synchronisation
        for i, t in zip(due, tokens):
            out[i] = t
        return out
