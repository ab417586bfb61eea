"""Runs one scheduled batch through the model: the one place that builds a step's inputs and forward context,
computes logits for the sequences due a token, and samples. The sampled ids are the only host read of a step.

Decode batches of a captured size replay a CUDA graph over static buffers (`DecodeBuffers`): a batch of n
sequences runs the graph of the smallest captured size b >= n; rows n..b-1 are padding (token 0 at position 0,
writing its K/V into the KV cache's pad block, attending to that block alone, routed to row 0's experts, so padding
never fetches or counts an expert; in a model whose layers keep a state per sequence, a padding row's is the state
cache's pad slot). Block tables are padded to the longest context the engine allows, so shapes
never change between replays, and a step's inputs reach the device as one copy.

Pre-step hooks: a module of the model that needs a step's token ids on the host before the step runs (the `disk`
per-layer embeddings stage their rows) defines `before_step(ids: list[int])`; the runner calls it with the step's
ids, after building the step's inputs and before the eager forward or the graph replay. The runner names none of them.

Warm-up (`warm_up`, at engine start-up on CUDA): dummy prompts whose blocks are all the pad block run through the
eager prefill path and the sampler, so that the first request finds the kernels compiled and the allocator grown.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from edgemoe.context import ForwardContext, set_context
from edgemoe.engine.cuda_graphs import DecodeGraphs
from edgemoe.engine.kv_cache import KVCache
from edgemoe.engine.parallel import TensorParallel
from edgemoe.engine.sampler import Sampler
from edgemoe.engine.scheduler import Batch
from edgemoe.engine.sequence import Sequence
from edgemoe.engine.state_cache import StateCache
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.sampling_params import SamplingParams

# (sequences due a token, their logits [due, vocab] float32) -> logits the sampler draws from
LogitsProcessor = Callable[[list[Sequence], torch.Tensor], torch.Tensor]

_FIELDS = 5  # ids, positions, KV slots, context lengths, state slots (int64); then the valid flags, the block tables


class DecodeBuffers:
    """Static decode inputs for up to `rows` sequences: one device buffer (int64) that one host copy fills, and its
    views. `valid` [rows] is False on padding rows."""

    def __init__(
        self, rows: int, max_blocks: int, pad_block: int, block_size: int, pad_state: int, device: torch.device
    ) -> None:
        """`pad_state`: the state cache's pad slot (0 where the model keeps no state)."""
        self.rows, self.max_blocks, self.pad_block, self.pad_state = rows, max_blocks, pad_block, pad_state
        self.pad_slot = pad_block * block_size
        self.flat = torch.zeros((_FIELDS + 1 + max_blocks) * rows, dtype=torch.long, device=device)
        fields = self.flat[: (_FIELDS + 1) * rows].view(_FIELDS + 1, rows)
        self.ids, self.positions, self.slots, self.context_lens, self.state_slots, valid = fields
        self.valid = torch.ones(rows, dtype=torch.bool, device=device)
        self._valid_long = valid
        self.block_tables = self.flat[(_FIELDS + 1) * rows :].view(rows, max_blocks)
        self.fill([], [], [], [], [], [])

    def fill(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        state_slots: list[int],
        tables: list,
    ) -> None:
        """The first len(ids) rows from these lists, the rest padding; one host-to-device copy."""
        n, pad = len(ids), self.rows - len(ids)
        width = self.max_blocks
        host = torch.tensor(
            [
                *ids, *[0] * pad,
                *positions, *[0] * pad,
                *slots, *[self.pad_slot] * pad,
                *context_lens, *[1] * pad,
                *state_slots, *[self.pad_state] * pad,
                *[1] * n, *[0] * pad,
                *[b for t in tables for b in (*t, *[self.pad_block] * (width - len(t)))],
                *[self.pad_block] * (width * pad),
            ],
            dtype=torch.long,
        )  # fmt: skip
        if self.flat.is_cuda:  # pinned staging: the copy does not wait for the host
            host = host.pin_memory()
        self.flat.copy_(host, non_blocking=True)
        self.valid.copy_(self._valid_long)

    def context(self, b: int, **extra) -> ForwardContext:
        """The forward context of a decode step over the first b rows."""
        return ForwardContext(
            False,
            self.slots[:b],
            self.context_lens[:b],
            self.block_tables[:b],
            valid=self.valid[:b],
            state_slots=self.state_slots[:b],
            **extra,
        )


def warmup_lengths(chunk: int, every_size: bool = False) -> list[int]:
    """What start-up prefills: a whole chunk (`chunk`: the longest prefill step), then 17, 16 and 1 tokens (Triton
    compiles an integer argument apart when it is 1, a multiple of 16, or neither). `every_size`: also each power of
    two from chunk / 2 down to 32, so that a shorter prompt finds the dense GEMMs' kernels for its size already
    launched (cuBLAS picks its kernels by shape, and CUDA loads a kernel at its first launch); for resident experts,
    where a prefill costs milliseconds (offloaded, each streams the experts it routes to)."""
    sizes = [chunk]
    while every_size and sizes[-1] // 2 >= 32:
        sizes.append(sizes[-1] // 2)
    return sizes + [n for n in (17, 16, 1) if n < chunk]


class ModelRunner:
    def __init__(
        self,
        model: MoEForCausalLM,
        kv: KVCache,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        states: StateCache | None = None,
        parallel: TensorParallel | None = None,
    ) -> None:
        """`states`: the state cache (already bound to the model), where the model keeps one; `parallel`: this
        process's rank of a tensor-parallel engine (rank 0 sends each eager step's inputs to the others)."""
        self.model, self.kv, self.device, self.states = model, kv, device, states
        self.parallel = parallel
        self.sampler = Sampler()
        self.logits_processors: list[LogitsProcessor] = []  # applied in order, before the sampler
        self.graphs: DecodeGraphs | None = None  # once `capture_graphs` ran (CUDA)
        pad_state = 0 if states is None else states.pad_slot
        self.decode = DecodeBuffers(max_num_seqs, max_blocks, kv.pad_block, kv.block_size, pad_state, device)
        self.routed_ids: torch.Tensor | None = None  # [moe_layers, max_num_seqs, top_k] once `record_routing` ran
        # a model with a multi-token-prediction head: each step's final hidden states, one row per token computed
        # (`hidden`; a graph's static ones by size), which the head drafts from (`mtp_forward`)
        self.keeps_hidden = getattr(model, "mtp", None) is not None
        self.hidden: torch.Tensor | None = None
        self._graph_hidden: dict[int, torch.Tensor] = {}
        self.step_hooks: list[Callable[[list[int]], None]] = [
            m.before_step for m in model.modules() if callable(getattr(m, "before_step", None))
        ]  # each module's `before_step`, called with a step's token ids (see the module docstring)
        kv.bind(model)

    def record_routing(self) -> torch.Tensor:
        """From now on every MoE layer writes each step's routed ids here (graphs included) -> the buffer."""
        cfg = self.model.config
        rows = (sum(cfg.moe_layers), self.decode.rows, cfg.top_k)
        self.routed_ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        return self.routed_ids

    def capture_graphs(self, sizes: list[int]) -> None:
        graphs = DecodeGraphs(sizes)
        graphs.capture(self.forward_static)
        self.graphs = graphs

    def forward_static(self, b: int, forced_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step over the first b rows of the static buffers -> logits [b, vocab] (what graphs capture).
        `forced_ids` [moe_layers, b, top_k]: routed ids that replace the router's (a routing trace)."""
        d = self.decode
        routed = None if self.routed_ids is None else self.routed_ids[:, :b]
        ctx = d.context(b, routed_ids=routed, forced_ids=forced_ids)
        logits = self._forward(d.ids[:b], d.positions[:b], ctx, logits_rows=None)
        if self.keeps_hidden:  # a graph of b captures this call last: its output stays the graph's
            self._graph_hidden[b] = self.hidden
        return logits

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_rows: torch.Tensor | list | None
    ) -> torch.Tensor | None:
        """-> logits of `logits_rows` (None: every row; an empty list: none, and no lm_head)."""
        set_context(ctx)
        try:
            hidden = self.model(ids, positions)
            if self.keeps_hidden:
                self.hidden = hidden
            if logits_rows is not None and not len(logits_rows):
                return None
            return self.model.logits(hidden if logits_rows is None else hidden[logits_rows])
        finally:
            set_context(None)

    def to_device(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host list -> device tensor without a host synchronisation: pinned staging, async copy. The staging
        buffer cannot be reused too early: the step's sampled-id read waits for everything before it."""
        host = torch.tensor(data, dtype=dtype)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _before_step(self, ids: list[int]) -> None:
        for hook in self.step_hooks:
            hook(ids)

    def host_inputs(self, batch: Batch) -> tuple[list[int], list[int], list[int], list[int], list[int], list]:
        """Token ids, positions and KV slots of the tokens computed this step; context length, state slot (a sequence
        without one, a warm-up's, uses the pad slot; 0 where the model keeps no state) and block table per sequence
        of a prefill step, per token of a decode step (`places`)."""
        pad_state, ids, state_slots = self.decode.pad_state, [], []
        starts = [seq.num_computed for seq in batch.seqs]
        for seq, start, n in zip(batch.seqs, starts, batch.num_new):
            ids += seq.step_ids(start, n)
            state = pad_state if seq.state_slot is None else seq.state_slot
            state_slots += [state] * (1 if batch.is_prefill else n)
        positions, slots, context_lens, tables = self.places(batch.seqs, starts, batch.num_new, batch.is_prefill)
        return ids, positions, slots, context_lens, state_slots, tables

    def places(
        self, seqs: list[Sequence], starts: list[int], counts: list[int], prefill: bool
    ) -> tuple[list[int], list[int], list[int], list]:
        """Positions and KV slots of counts[i] tokens of each sequence from position starts[i]; context length and
        block table per sequence (prefill), or per token (decode): a decode step's rows are tokens, each attending up
        to its own position, so a verify step's drafted positions are rows of their sequence, computed as a decode
        step at each of those positions would compute them (the K/V of the row before is written before any row
        attends)."""
        bs = self.kv.block_size
        positions, slots, context_lens, tables = [], [], [], []
        for seq, start, n in zip(seqs, starts, counts):
            for p in range(start, start + n):
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            ends = [start + n] if prefill else range(start + 1, start + n + 1)
            for end in ends:
                context_lens.append(end)
                tables.append(seq.block_table)
        return positions, slots, context_lens, tables

    def prepare(self, batch: Batch, inputs: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """Inputs of an eager step: tensors of the batch's own shape (`inputs`: `host_inputs(batch)`, if made)."""
        inputs = inputs or self.host_inputs(batch)
        if self.parallel is not None:  # rank 0: every rank runs this forward on its shard (`run_sent`)
            journal = self.states.take_journal() if self.states is not None else []  # its state rows' changes first
            self.parallel.send((batch.is_prefill, list(batch.num_new), inputs, journal))
        ids, positions, slots, context_lens, state_slots, tables = inputs
        self._before_step(ids)
        routed = None
        if self.routed_ids is not None and not batch.is_prefill:
            routed = self.routed_ids[:, : len(ids)]
        states = self.to_device(state_slots) if self.states is not None else None
        ctx = self._context(batch.is_prefill, batch.num_new, slots, context_lens, tables, routed, states)
        return self.to_device(ids), self.to_device(positions), ctx

    def _context(
        self,
        prefill: bool,
        counts: list[int],
        slots: list[int],
        context_lens: list[int],
        tables: list,
        routed: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ) -> ForwardContext:
        """An eager step's forward context (block tables padded to the longest)."""
        width = max(map(len, tables))
        tables = [t + [self.kv.pad_block] * (width - len(t)) for t in tables]
        return ForwardContext(
            is_prefill=prefill,
            slot_mapping=self.to_device(slots),
            context_lens=self.to_device(context_lens),
            block_tables=self.to_device(tables),
            query_lens=list(counts) if prefill else None,
            context_lens_host=context_lens if prefill else None,
            routed_ids=routed,
            state_slots=states,
        )

    @torch.inference_mode()
    def run_sent(self, step: tuple) -> None:
        """A worker rank: the forward rank 0's `prepare` sent (its logits are rank 0's to take)."""
        prefill, counts, (ids, positions, slots, context_lens, state_slots, tables), journal = step
        if self.states is not None:  # what rank 0 did to its state rows since the last forward (`StateCache.journal`)
            self.states.apply(journal)
        states = self.to_device(state_slots) if self.states is not None else None
        ctx = self._context(prefill, counts, slots, context_lens, tables, None, states)
        self._forward(self.to_device(ids), self.to_device(positions), ctx, [])

    @torch.inference_mode()
    def mtp_forward(
        self,
        seqs: list[Sequence],
        starts: list[int],
        counts: list[int],
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        step: int,
        draft_rows: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's multi-token-prediction head (`edgemoe.models.mtp`; chained step `step`) at counts[i] positions
        of each sequence from position starts[i]: `hidden` [rows, hidden] the decoder's final hidden states there (or
        the head's own, for a chained step), `next_ids` [rows] the token after each -> (the head's hidden states
        [rows, hidden], the greedy token it predicts at `draft_rows` (None: every row; []: none, and None), on the
        device). Its K/V goes to the head layer's KV cache at those positions. The rows run as a decode step's (each
        attending up to its own position) where a decode step could hold them, else as a prefill step's."""
        prefill = sum(counts) > self.decode.rows
        positions, slots, context_lens, tables = self.places(seqs, starts, counts, prefill)
        set_context(self._context(prefill, counts, slots, context_lens, tables))
        try:
            out = self.model.mtp(self.model.model, hidden, next_ids, self.to_device(positions), step)
            if draft_rows is not None and not draft_rows:
                return out, None
            rows = out if draft_rows is None else out[self.to_device(draft_rows)]
            return out, self.model.mtp.logits(self.model, rows).argmax(dim=-1)
        finally:
            set_context(None)

    @torch.inference_mode()
    def compute_logits(self, batch: Batch) -> tuple[list[int], torch.Tensor | None]:
        """Run the batch; return the indices of the rows due a token and their logits [due, vocab] (float32).

        A decode step's rows are its tokens (one a sequence, or a verify step's drafted positions too), all due;
        it replays a captured CUDA graph when there is one of its size. A prefill step's rows are its sequences: one
        is due when this step computes its last uncached token (a prefill chunk that does not end its prompt is
        not)."""
        if not batch.is_prefill:
            inputs = self.host_inputs(batch)
            rows = len(inputs[0])
            b = None if self.graphs is None else self.graphs.size_for(rows)
            if b is not None:
                self.decode.fill(*inputs)
                self._before_step(inputs[0])
                logits = self.graphs.replay(b)[:rows]
                if self.keeps_hidden:
                    self.hidden = self._graph_hidden[b][:rows]
                return list(range(rows)), logits
            input_ids, positions, ctx = self.prepare(batch, inputs)
            return list(range(rows)), self._forward(input_ids, positions, ctx, None)
        input_ids, positions, ctx = self.prepare(batch)
        due = [i for i, (s, k) in enumerate(zip(batch.seqs, batch.num_new)) if s.num_computed + k == len(s.token_ids)]
        ends = [sum(batch.num_new[: i + 1]) - 1 for i in due]
        return due, self._forward(input_ids, positions, ctx, self.to_device(ends) if due else [])

    @torch.inference_mode()
    def warm_up(self, length: int) -> None:
        """Prefill a prompt of `length` tokens and sample its next token (thrown away). Its blocks are all the KV
        cache's pad block, which padding rows write and read too: no block is allocated or cached, no sequence's K/V
        is touched. Logits processors are not called (they may expect real requests). A model with a
        multi-token-prediction head runs it over the same rows."""
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)  # every filter of the sampler
        # varied ids, so that routing spreads as a real prompt's does: one token repeated routes every position to
        # the same top_k experts, and the prefill paths of many experts (quantized experts' dequantized waves, the
        # grouped GEMM's tiles) would meet their first real prompt unwarmed and unmeasured
        vocab = self.model.config.vocab_size
        seq = Sequence([(7919 * i + 13) % vocab for i in range(length)], params, None, None)
        seq.block_table = [self.kv.pad_block] * -(-length // self.kv.block_size)
        _, logits = self.compute_logits(Batch([seq], [length], True))
        if self.keeps_hidden:  # the MTP head's kernels too, on the same pad blocks (a decode step's rows at length 1)
            self.mtp_forward([seq], [0], [length], self.hidden, self.to_device(seq.token_ids), 0, [length - 1])
            self.hidden = None
        gen = torch.Generator(self.device).manual_seed(0)  # not the global generator
        floats = [self.to_device([v], torch.float32) for v in (params.temperature, params.top_p, params.min_p)]
        self.sampler(logits, floats[0], self.to_device([params.top_k]), *floats[1:], [gen]).tolist()

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int | None]:
        """Next token per sequence of the batch; None for a prefill chunk that does not end its prompt."""
        due, logits = self.compute_logits(batch)
        out: list[int | None] = [None] * len(batch.seqs)
        if not due:
            return out
        seqs = [batch.seqs[i] for i in due]
        for process in self.logits_processors:
            logits = process(seqs, logits)
        for i, t in zip(due, self._sample(seqs, logits).tolist()):  # the step's one host synchronisation
            out[i] = t
        return out

    @torch.inference_mode()
    def verify(self, batch: Batch) -> list[list[int]]:
        """A verify step (`Batch.verify`): per sequence its next tokens. A sequence with a draft gets the argmax at its
        next position and at each drafted one up to the first draft that differs from the argmax before it (accepted
        drafts, then the model's token where a draft failed, or one more after the last): 1 to len(draft) + 1 tokens,
        as greedy decoding would give them one a step, each row computed as that step would compute it. One without
        a draft gets its one sampled token, its logits through the logits processors first (the drafter drafts for no
        sequence a processor may change)."""
        if self.states is None:
            _, logits = self.compute_logits(batch)
        else:  # rows of one sequence cannot share its recurrent state: the drafts go as a prefill chunk, undoable
            for i, seq in enumerate(s for s in batch.seqs if s.draft):
                self.states.stash(seq.state_slot, i)
            chunk = Batch(batch.seqs, batch.num_new, is_prefill=True)
            input_ids, positions, ctx = self.prepare(chunk)
            logits = self._forward(input_ids, positions, ctx, None)  # every position's row
        ends = list(itertools.accumulate(batch.num_new))
        plain = [i for i, s in enumerate(batch.seqs) if not s.draft]
        sampled = None
        if plain:  # the undrafted sequences as a plain step samples them (logits processors included)
            seqs, rows = [batch.seqs[i] for i in plain], logits[[ends[i] - 1 for i in plain]]
            for process in self.logits_processors:
                rows = process(seqs, rows)
            sampled = self._sample(seqs, rows)
        picked = logits.argmax(dim=-1)  # every row's greedy token, then the undrafted sequences' draws
        picked = (picked if sampled is None else torch.cat([picked, sampled])).tolist()  # the step's one host read
        greedy, drawn = picked[: logits.shape[0]], iter(picked[logits.shape[0] :])
        out = []
        for seq, end, n in zip(batch.seqs, ends, batch.num_new):
            if not seq.draft:
                out.append([next(drawn)])
                continue
            rows = greedy[end - n : end]
            kept = next((i for i, d in enumerate(seq.draft) if rows[i] != d), len(seq.draft))
            out.append(rows[: kept + 1])
        if self.states is not None:  # a sequence that did not keep every draft: its state as before the step
            for i, (seq, tokens) in enumerate((s, t) for s, t in zip(batch.seqs, out) if s.draft):
                if len(tokens) <= len(seq.draft):
                    self.states.unstash(i, seq.state_slot)
        return out

    def kept_positions(self, seq: Sequence, accepted: int) -> int:
        """After `verify`, the positions of a drafted sequence that stay computed: its next token's and the accepted
        drafts'; none where a recurrent state was undone (those tokens are computed again with the next step's)."""
        if self.states is not None and accepted < len(seq.draft):
            return 0
        return 1 + accepted

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        params = [s.params for s in seqs]
        return self.sampler(
            logits,
            self.to_device([p.temperature for p in params], torch.float32),
            self.to_device([p.top_k for p in params]),
            self.to_device([p.top_p for p in params], torch.float32),
            self.to_device([p.min_p for p in params], torch.float32),
            [None if p.greedy else s.generator for p, s in zip(params, seqs)],
        )
