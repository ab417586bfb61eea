"""LLMEngine: loads a checkpoint, takes requests, and advances them one step at a time.

Entry points (`LLM`, the CLI, the server) drive it with `add_request` / `step` / `abort`.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from edgemoe.config import EngineConfig, ExpertCacheConfig, parse_size, ram_budget
from edgemoe.engine.activations import (
    ACTIVATION_SHARE,
    OFFLOAD_CHUNK_CAP,
    PREFILL_CHUNK,
    dequant_scratch_bytes,
    offload_prefill_chunk,
    prefill_activation_bytes,
)
from edgemoe.engine.cuda_graphs import default_batch_sizes
from edgemoe.engine.device import resolve_device, resolve_dtype
from edgemoe.engine.grammar import GrammarConstraint
from edgemoe.engine.kv_cache import KVCache, bytes_per_block, kv_blocks
from edgemoe.engine.model_runner import ModelRunner, warmup_lengths
from edgemoe.engine.mtp import MTPDrafter
from edgemoe.engine.parallel import (
    Cut,
    TensorParallel,
    expert_unit,
    follow_parent,
    join,
    shard_config,
    shard_model,
    stored_unit_bytes,
)
from edgemoe.engine.parallel import check as check_parallel
from edgemoe.engine.scheduler import Batch, Scheduler
from edgemoe.engine.sequence import RequestOutput, Sequence
from edgemoe.engine.speculative import Acceptance, NgramIndex, SpeculationGate, SpeculativeStats
from edgemoe.engine.state_cache import StateCache, bytes_per_slot
from edgemoe.engine.streams import side_stream
from edgemoe.errors import EdgeMoEError
from edgemoe.layers.ple import PLEOptions
from edgemoe.models.gguf import GGUFCheckpoint
from edgemoe.models.loader import LoadOptions, checkpoint_files, count_parameters, load_gguf, load_model
from edgemoe.models.registry import family_value, read_checkpoint
from edgemoe.moe.layer import set_shared_expert_stream
from edgemoe.moe.routing_trace import RoutingRecorder
from edgemoe.offload.banks import TierOptions
from edgemoe.offload.expert_cache import ExpertCache, RefusedDrafts
from edgemoe.offload.experts import MiB, attach_expert_cache, cache_slots, expert_bytes, min_cache_slots
from edgemoe.sampling_params import SamplingParams
from edgemoe.tokenizer import IncrementalDetokenizer, Tokenizer


def demo_model_path() -> Path:
    """The bundled demo model (a small qwen2_moe trained on Shakespeare and Milton)."""
    return Path(__file__).resolve().parent.parent / "demo_model"


def _unreadable_checkpoint(folder: Path, exc: SafetensorError) -> str:
    """One line for weights safetensors cannot read (a truncated or corrupt file: an interrupted download), naming
    the file."""

    def opens(path: Path) -> bool:
        try:
            safe_open(str(path), framework="pt")
        except SafetensorError:
            return False
        return True

    bad = next((f for f in checkpoint_files(folder) if not opens(f)), folder)
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"cannot read {bad}: {reason} (a truncated or corrupt file, e.g. an interrupted download?)"


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel: TensorParallel | None = None) -> None:
        """`parallel`: this process's rank where it is a worker of a tensor-parallel engine (`edgemoe.engine.parallel`;
        the engine is then its shard and its runner, which serves rank 0's steps); rank 0 starts the workers."""
        start = time.perf_counter()
        self.config = config
        path = Path(config.model) if config.model else demo_model_path()
        self.model_name = path.resolve().name if config.model else "the demo model"
        self.model_config, family, gguf = read_checkpoint(path, mtp=config.speculative == "mtp")
        self.num_params = count_parameters(self.model_config, family)
        cfg = self.model_config  # (the whole model's: a tensor-parallel rank's config below holds its share)
        self.num_expert_params = cfg.expert_params * cfg.num_experts * sum(cfg.moe_layers)
        started = False
        self._unit = 1  # the weights the routed experts' intermediate axis splits in among tensor-parallel ranks
        self._segments: dict[str, list[int]] = {}
        if config.tensor_parallel > 1:
            blocks = None if gguf is None else gguf.expert_blocks(self.model_config)
            self._unit = expert_unit(config, self.model_config, blocks)
            check_parallel(config, self.model_config, config.tensor_parallel, self._unit)
            own = getattr(family, "shard_config", None)  # a family's own shapes (the hybrids' linear attention heads)
            segments = getattr(family, "split_segments", None)  # tensors whose rows split in runs (the full shapes')
            self._segments = {} if segments is None else segments(self.model_config)
            if own is not None:
                own(self.model_config, config.tensor_parallel)  # its refusals, before anything is spawned
            started = parallel is None
            parallel = parallel or TensorParallel.start(config, _rank_main)
            # this rank's share of the shapes
            self.model_config = shard_config(self.model_config, parallel.world, parallel.rank, self._unit)
            if own is not None:
                self.model_config = own(self.model_config, parallel.world)
        self.parallel = parallel
        try:
            self._build(config, path, family, gguf, start)
        except BaseException:
            if parallel is not None and started:  # the workers it spawned may wait in any collective
                parallel.abort()
            raise

    def _build(
        self, config: EngineConfig, path: Path, family: ModuleType, gguf: GGUFCheckpoint | None, start: float
    ) -> None:
        """The rest of start-up, once the checkpoint is read (and a tensor-parallel engine's ranks are up)."""
        parallel = self.parallel
        self.device = resolve_device(config.device)
        if parallel is not None:
            self.device = parallel.device(self.device)
        self.dtype, self.dtype_reason = resolve_dtype(config.dtype, self.device, self.model_config, self.num_params)
        if gguf is not None and config.moe.expert_dtype != "auto":  # a bad flag: before the loading line
            raise EdgeMoEError("expert_dtype quantizes a safetensors checkpoint's experts; a GGUF's stay as stored")
        # the checkpoint's config and the settings are sound: what follows reads the weights (the start-up line,
        # `edgemoe.engine.summary`, says when it is done)
        print(f"edgemoe: loading {self.model_name} ...", file=sys.stderr, flush=True)
        self.tokenizer = Tokenizer(path) if gguf is None else gguf.tokenizer()
        self.max_model_len = min(config.max_model_len or sys.maxsize, self.model_config.max_position_embeddings)
        moe = config.moe
        offload = moe.moe_strategy == "offload"
        # the disk backend's staging holds a step's tokens: a prefill chunk's or a decode batch's (a default chunk is
        # chosen only once the weights are placed; a longer step than the staging holds is gathered in pieces)
        chunk = config.max_num_batched_tokens or PREFILL_CHUNK
        ple = PLEOptions(config.ple_backend, config.ple_sync, max(chunk, config.max_num_seqs))
        try:
            # where experts are offloaded the card's memory is what limits: the token embedding in host memory, a
            # GGUF's dense weights as stored; resident, they are dequantized, the bf16 GEMVs being the faster
            # (docs/findings.md, "Quantized dense weights and quantized prefill")
            placed = offload and self.device.type == "cuda"
            tier = None
            if moe.ram_budget is not None:
                folder = None if moe.expert_store is None else Path(moe.expert_store).expanduser()
                tier = TierOptions(ram_budget(moe.ram_budget), folder, config.max_num_seqs)
            share = None
            if parallel is not None:
                packed = stored_unit_bytes(self.model_config, self._unit) if gguf is None else None
                model_type = self.model_config.model_type
                heads = family_value(model_type, "SPLIT_WITH_HEADS", ())
                columns = family_value(model_type, "SPLIT_COLUMNS_WITH_HEADS", ())
                share = Cut(parallel.rank, parallel.world, self._unit, packed, heads, columns, self._segments)
            as_stored = placed and parallel is None  # (a tensor-parallel rank dequantizes its share of each)
            opts = LoadOptions(
                self.device, self.dtype, config.progress, offload, moe.expert_dtype, ple, placed, as_stored, tier, share
            )
            if gguf is None:
                self.model = load_model(path, self.model_config, family, opts)
            else:
                self.model = load_gguf(gguf, self.model_config, family, opts)
        except SafetensorError as exc:
            raise EdgeMoEError(_unreadable_checkpoint(path, exc)) from None
        except torch.OutOfMemoryError:
            raise EdgeMoEError(
                f"the weights do not fit the memory of {self.device}{'' if offload else ': try moe_strategy offload'}"
            ) from None
        self.max_num_batched_tokens = chunk  # the prefill chunk, set by `_place`
        self.plan: dict[str, int] = {}  # device bytes by part, as `_place` planned them
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak reported at start-up: placement onwards
        if parallel is not None:  # the ranks' shares summed where layers return to the hidden size
            shard_model(self.model)
        self.expert_cache = self._place(moe)
        seqs, invariant = config.max_num_seqs, config.batch_invariant
        drafter = self._draft if config.speculative != "off" else None
        self.speculative, self.gate = SpeculativeStats(), SpeculationGate()
        self._ngrams: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()
        self._acceptance: weakref.WeakKeyDictionary[Sequence, Acceptance] = weakref.WeakKeyDictionary()
        self.scheduler = Scheduler(self.kv, seqs, self.max_num_batched_tokens, invariant, self.states, drafter)
        max_blocks = self.scheduler.blocks_for(self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv, self.device, seqs, max_blocks, self.states, parallel)
        if parallel is not None and parallel.rank:
            return  # a worker: `TensorParallel.serve` runs rank 0's steps through this runner
        self.mtp = MTPDrafter(self.runner, self.scheduler) if config.speculative == "mtp" else None
        self._refused = self._refused_drafts() if drafter is not None else None  # before the graphs: they record it
        # Callables (sequences due a token, their logits [due, vocab]) -> logits, run in order before the sampler:
        # constrained decoding, banned tokens; the server tests force scripted outputs through one.
        self.logits_processors = self.runner.logits_processors
        self.recorder = None
        if moe.record_routing:
            self.recorder = RoutingRecorder(self.runner.record_routing(), moe.record_routing)
        if self.device.type == "cuda" and config.shared_expert_overlap:
            # resident too: with every expert cached the side stream still gains (docs/findings.md, "Side stream")
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            set_shared_expert_stream(self.model, side_stream(index))
        if self.device.type == "cuda" and config.warmup:
            self._warm_up()
        if self.device.type == "cuda" and config.cuda_graphs and parallel is None:  # (not split yet: eager)
            self._capture_graphs()
        self.memory_line = self._memory_line(moe) if self.device.type == "cuda" else None
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._seed_gen = torch.Generator()  # seeds the requests that give none: a fresh seed unless one is set
        if config.seed is None:
            self._seed_gen.seed()
        else:
            self._seed_gen.manual_seed(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._constraint: GrammarConstraint | None = None  # the grammars of the requests that have one
        self.load_seconds = time.perf_counter() - start  # the whole start-up: weights, KV cache, warm-up, graphs

    def close(self) -> None:
        """End a tensor-parallel engine's workers (also at exit); nothing otherwise."""
        if self.parallel is not None:
            self.parallel.close()

    def _place(self, moe: ExpertCacheConfig) -> ExpertCache | None:
        """Choose the prefill chunk (`_prefill_chunk`) and allocate the KV cache, the state cache where the model's
        layers keep a state per sequence, and, when experts are offloaded, the expert cache, within `vram_budget` if
        set: device memory = dense weights + per-sequence states + prefill activations + KV + expert slots (+ one
        scratch slot). Without a budget, an explicitly sized slot pool comes first, the chunk fits what it leaves,
        and the KV cache takes its usual share of that."""
        offload, cfg = moe.moe_strategy == "offload", self.model_config
        self.states = self._state_cache()
        if self.states is not None and self.parallel is not None and self.parallel.rank == 0:
            self.states.journal = []  # the other ranks' rows follow rank 0's (`ModelRunner.prepare` sends the changes)
        state = 0 if self.states is None else self.states.num_bytes  # fixed, as the weights: counted with them
        weights = state + sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        budget = None if moe.vram_budget is None else parse_size(moe.vram_budget)
        if budget is None and offload and moe.moe_cache_slots is None and moe.moe_cache_fraction is None:
            if self.device.type != "cuda":
                raise EdgeMoEError(
                    "moe_strategy offload on the cpu needs moe_cache_slots, moe_cache_fraction or vram_budget"
                )
            budget = weights + int(torch.cuda.mem_get_info(self.device)[0] * 0.9)
        per_expert = expert_bytes(self.model, self.dtype)
        reserve = (min_cache_slots(cfg, self.config.max_num_seqs) + 1) * per_expert if offload else 0
        per_block = bytes_per_block(cfg, self.config.block_size, self.dtype)
        cache = None
        if offload and budget is None:
            cache = self._attach_cache(moe, cache_slots(moe, cfg, self.config.max_num_seqs, per_expert, None))
        scratch = dequant_scratch_bytes(self.model, self.dtype)  # GGUF blocks dequantized for prefill's GEMMs
        room = None if budget is None else budget - weights - reserve - scratch
        acts, chunk_why = self._prefill_chunk(offload, room)
        acts += scratch
        if budget is not None and budget - weights - acts - reserve < per_block:
            parts = (
                f"{'dense ' if offload else ''}weights{' and per-sequence states' if state else ''} take "
                f"{weights / MiB:.1f} MiB, prefill activations "
                f"{acts / MiB:.1f} MiB, one KV block {per_block / MiB:.2f} MiB"
            )
            parts += f", the smallest expert cache {reserve / MiB:.1f} MiB" if offload else ""
            raise EdgeMoEError(
                f"vram_budget {moe.vram_budget} is too small: {parts}; the minimum is "
                f"{(weights + acts + per_block + reserve) / MiB:.1f} MiB"
                f"{'' if offload else ' (or use moe_strategy offload)'}"
            )
        kv_room = None if budget is None else budget - weights - acts - reserve
        if offload and kv_room is not None:
            kv_room //= 4  # KV "auto" under a budget takes at most a quarter: the rest caches experts
        blocks, why = kv_blocks(self.config, per_block, self.max_model_len, self.device, kv_room)
        if self.parallel is not None:  # rank 0's count on every rank: its block tables index every rank's cache
            blocks = self.parallel.common(blocks)
        try:
            self.kv = KVCache(cfg, blocks, self.config.block_size, self.dtype, self.device, self.config.prefix_cache)
        except RuntimeError:  # torch's out-of-memory errors (CUDA's is a subclass)
            raise EdgeMoEError(
                f"cannot allocate a KV cache of {blocks * per_block / MiB:.1f} MiB on {self.device} ({why}): "
                "lower kv_cache_memory, kv_cache_tokens, max_model_len or max_num_seqs"
            ) from None
        kv_bytes = 2 * self.kv.k.numel() * self.kv.k.element_size()
        self.plan = {"weights": weights - state, "prefill": acts, "kv": kv_bytes} | ({"state": state} if state else {})
        if budget is not None and weights + acts + kv_bytes + reserve > budget:
            raise EdgeMoEError(
                f"vram_budget {moe.vram_budget} is too small for the KV cache ({why}): the "
                f"minimum is {(weights + acts + kv_bytes + reserve) / MiB:.1f} MiB"
            )
        chunk = self.max_num_batched_tokens
        print(
            f"edgemoe: prefill: chunks of {chunk} tokens, {acts / MiB:.1f} MiB of activations ({chunk_why})",
            file=sys.stderr,
        )
        print(
            f"edgemoe: KV cache: {blocks * self.config.block_size} tokens, {kv_bytes / MiB:.1f} MiB ({why})",
            file=sys.stderr,
        )
        if offload and cache is None:
            slots = cache_slots(moe, cfg, self.config.max_num_seqs, per_expert, budget - weights - acts - kv_bytes)
            if self.parallel is not None:  # uneven shares of the experts: the fewest slots, so every rank decides alike
                slots = self.parallel.least(slots)
            note = (
                f"; budget {budget / MiB:.1f} MiB: dense {(weights - state) / MiB:.1f} MiB, "
                + (f"state {state / MiB:.1f} MiB, " if state else "")
                + f"prefill {acts / MiB:.1f} MiB, "
                f"KV {kv_bytes / MiB:.1f} MiB"
            )
            cache = self._attach_cache(moe, slots, note)
        return cache

    def _state_cache(self) -> StateCache | None:
        """The per-sequence states of the layers that keep one (`edgemoe.engine.state_cache`), one slot per running
        sequence, and with the prefix cache as many snapshot rows (each running sequence's latest block boundary,
        kept after it ends for a later request that starts with the same prefix); None for a model without such
        layers."""
        per_slot = bytes_per_slot(self.model, self.dtype)
        if not per_slot:
            return None
        seqs = self.config.max_num_seqs
        snapshots = seqs if self.config.prefix_cache else 0
        stashes = seqs if self.config.speculative != "off" else 0  # a verify step's undo
        try:
            states = StateCache(self.model, seqs, self.dtype, self.device, snapshots, stashes)
        except RuntimeError:  # torch's out-of-memory errors (CUDA's is a subclass)
            raise EdgeMoEError(
                f"cannot allocate the per-sequence state of {seqs} sequences and {snapshots} snapshots "
                f"({seqs + snapshots + stashes} x {per_slot / MiB:.1f} MiB) on {self.device}: lower max_num_seqs"
                + (" or turn the prefix cache off" if snapshots else "")
            ) from None
        kept = f" + {snapshots} snapshots for the prefix cache" if snapshots else ""
        kept += f" + {stashes} for speculative decoding's undo" if stashes else ""
        print(
            f"edgemoe: state cache: {seqs} sequences{kept} x {per_slot / MiB:.1f} MiB (the linear-attention layers' "
            f"state), {states.num_bytes / MiB:.1f} MiB",
            file=sys.stderr,
        )
        return states

    def _prefill_chunk(self, offload: bool, room: int | None) -> tuple[int, str]:
        """Set `max_num_batched_tokens`, the prefill chunk: the user's, else `PREFILL_CHUNK` with resident experts, or
        offloaded the largest that `room` bytes allow (None: the free device memory; no limit on the CPU; see
        `edgemoe.engine.activations`) -> the bytes of its activations (`prefill_activation_bytes`), and why."""
        cfg, seqs, context = self.model_config, self.config.max_num_seqs, self.max_model_len
        if self.config.max_num_batched_tokens is not None:
            chunk, why = self.config.max_num_batched_tokens, "max_num_batched_tokens"
        elif not offload:
            chunk, why = PREFILL_CHUNK, "resident experts"
        else:
            if room is None and self.device.type == "cuda":
                room = torch.cuda.mem_get_info(self.device)[0]
            chunk = offload_prefill_chunk(cfg, self.dtype, seqs, context, room)
            fits = (
                "" if room is None else f" whose activations fit 1/{ACTIVATION_SHARE} of {max(room, 0) / MiB:.1f} MiB"
            )
            why = f"offloaded experts, streamed once a chunk: the largest power of two <= {OFFLOAD_CHUNK_CAP}{fits}"
        self.max_num_batched_tokens = chunk
        return prefill_activation_bytes(cfg, min(chunk, seqs * context), seqs, context, self.dtype), why

    def _warm_up(self) -> None:
        """Dummy prefills (`ModelRunner.warm_up`, their K/V in the pad block); then the expert cache starts empty, as
        if none ran."""
        lengths = warmup_lengths(min(self.max_num_batched_tokens, self.max_model_len), self.expert_cache is None)
        for n in tqdm(lengths, desc="warming up", unit="prefill", disable=not self.config.progress or None):
            self.runner.warm_up(n)
        if self.expert_cache is not None:
            self.expert_cache.reset()

    def _capture_graphs(self) -> None:
        sizes = default_batch_sizes(self.config.max_num_seqs)
        self.runner.capture_graphs(sizes)
        split = None if self.expert_cache is None else self.expert_cache.cpu_split
        if split is not None and split.fitted:  # `auto`'s last word: the split against copy-only, replayed
            split.check_replayed(lambda: self.runner.graphs.replay(sizes[0]), self.expert_cache.reset)
        if self.expert_cache is not None:
            self.expert_cache.reset()  # capture's warm-up steps are not the user's: start empty, as eager does
        if self.recorder is not None:
            self.recorder.routed_ids.zero_()

    def _memory_line(self, moe: ExpertCacheConfig) -> str:
        """One line on where the device's bytes went: the plan by part, and the peak torch allocated from placement
        through warm-up and graph capture (the CUDA context and the driver's own are outside both); a warning where
        the peak passed `vram_budget`."""
        plan = self.plan | {"expert cache": 0 if self.expert_cache is None else self.expert_cache.pool_bytes}
        peak = torch.cuda.max_memory_allocated(self.device)
        parts = ", ".join(f"{k} {v / MiB:.0f}" for k, v in plan.items())
        line = f"edgemoe: GPU memory (MiB): {parts}; peak allocated {peak / MiB:.0f} after warm-up and graph capture"
        if moe.vram_budget is not None:
            budget = parse_size(moe.vram_budget)
            over = peak - budget
            line += f", budget {budget / MiB:.0f}" + (f" (over by {over / MiB:.0f})" if over > 0 else "")
        print(line, file=sys.stderr)
        return line

    def _attach_cache(self, moe: ExpertCacheConfig, slots: int, note: str = "") -> ExpertCache:
        cfg = self.model_config
        graphs, cpu = self.device.type == "cuda" and self.config.cuda_graphs, moe.moe_cpu_compute
        cache = attach_expert_cache(self.model, slots, moe.moe_policy, moe.moe_collect_stats, self.device, self.dtype,
                                    cpu, graphs, self.config.max_num_seqs, moe.moe_cpu_threads)  # fmt: skip
        total, size = cfg.num_experts * sum(cfg.moe_layers), (slots + 1) * expert_bytes(self.model, self.dtype)
        print(
            f"edgemoe: expert cache: {slots} of {total} experts ({100 * slots / total:.1f} %), {size / MiB:.1f} MiB, "
            f"policy {moe.moe_policy}{note}",
            file=sys.stderr,
        )
        return cache

    def moe_stats(self) -> dict:
        """Per-layer expert-cache counters (accesses, hits, misses, evictions, bytes copied) and their total."""
        if self.expert_cache is None or not self.expert_cache.collect_stats:
            raise EdgeMoEError("expert-cache statistics are off: use moe_strategy offload with moe_collect_stats")
        return self.expert_cache.stats_dict([i for i, layer in enumerate(self.model.model.layers) if layer.is_moe])

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, chat: bool = False
    ) -> Sequence:
        params.validate()
        if chat:
            ids = self.tokenizer.encode_chat(prompt)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or t < 0 or t >= self.model_config.vocab_size for t in ids):
                raise EdgeMoEError(f"token ids must be integers in [0, {self.model_config.vocab_size})")
        if not ids:
            raise EdgeMoEError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise EdgeMoEError(f"the prompt has {len(ids)} tokens; the context limit is {self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.scheduler.blocks_for(longest) > self.kv.num_blocks:
            raise EdgeMoEError(
                f"a sequence of {longest} tokens does not fit the KV cache "
                f"({self.kv.num_blocks * self.kv.block_size} tokens); raise kv_cache_memory or kv_cache_tokens"
            )
        matcher = self._grammar().matcher(params.grammar) if params.grammar is not None else None
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_gen))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        seq = Sequence(ids, params, detok, generator, request_id)
        if matcher is not None:
            self._grammar().attach(seq, matcher)
        if seq.request_id in self._seqs:
            raise EdgeMoEError(f"request id {seq.request_id!r} is already in use")
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def _grammar(self) -> GrammarConstraint:
        """Constrained decoding, set up by the first request with a grammar (building the grammar library's view of
        the vocabulary takes a moment) and run after the other logits processors."""
        if self._constraint is None:
            self._constraint = GrammarConstraint(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
            self.logits_processors.append(self._constraint)
        return self._constraint

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every sequence that advanced."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if self.recorder:
            self.recorder.begin(batch)
        start = time.perf_counter()
        try:
            if batch.verify:
                if self._refused is not None:
                    self._refused.clear()
                tokens = self.runner.verify(batch)
                if self._refused is not None:
                    self._count_refused(self._refused, batch, tokens)
            else:
                tokens = [None if t is None else [t] for t in self.runner.run(batch)]
        except RuntimeError as exc:  # a collective of a tensor-parallel step (an all-reduce) whose peer is gone
            if self.parallel is None or isinstance(exc, torch.OutOfMemoryError):
                raise
            raise self.parallel.failure(exc) from None
        outputs, starts, kept = [], [seq.num_computed for seq in batch.seqs], []
        for seq, n, new in zip(batch.seqs, batch.num_new, tokens):
            if seq.draft:  # its next token and the accepted drafts are computed; the positions after, not
                accepted = len(new) - 1
                self.speculative.add(len(seq.draft), accepted)
                self._acceptance_of(seq).record(len(seq.draft), accepted)
                n, seq.draft = self.runner.kept_positions(seq, accepted), []
            kept.append(n)
            seq.num_computed += n
            self.scheduler.commit(seq)
            if new is None:
                continue
            for token in new:
                self._append(seq, token)
                if seq.finish_reason:
                    break
            if seq.finish_reason:
                self.scheduler.finish(seq)
                self._seqs.pop(seq.request_id, None)
            outputs.append(seq.output())
        if self.mtp is not None:  # the head at the kept positions, and the next step's drafts
            self.mtp.after_step(batch, starts, kept, self._draft_room)
        if self.scheduler.drafter is not None and not batch.is_prefill:  # what each kind of decode step yields
            seconds = time.perf_counter() - start
            self.gate.record(batch.verify, sum(map(len, tokens)), len(tokens), seconds, sum(batch.num_new))
            # (an undone hybrid verify step's tokens still cost their recompute in a later step: counted there)
        if self.recorder:
            self.recorder.end(batch)
        return outputs

    def _refused_drafts(self) -> RefusedDrafts | None:
        """The record of what refused drafts cost the expert cache (offloaded experts, stats collected), kept by the
        cache's `fetch`; None where there is none to keep, or the drafts verify as a prefill chunk (the hybrids:
        their experts come in prefill's waves, which it does not see)."""
        cache = self.expert_cache
        if cache is None or not cache.collect_stats or self.states is not None:
            return None
        rows, top_k = self.config.max_num_seqs, self.model_config.top_k
        cache.drafts = RefusedDrafts(cache.num_layers, cache.num_experts, rows, top_k, cache.expert_bytes, self.device)
        return cache.drafts

    def _count_refused(self, drafts: RefusedDrafts, batch: Batch, tokens: list[list[int]]) -> None:
        """A verify step's rows, kept (a sequence's next position and its accepted drafts) or refused (the drafts
        after the first one refused), to the record (device tensors: no host sync)."""
        kept, refused = [], []
        for seq, n, new in zip(batch.seqs, batch.num_new, tokens):
            used = len(new) if seq.draft else n
            kept += [True] * used + [False] * (n - used)
            refused += [False] * used + [True] * (n - used)
        pad = drafts.ids.shape[1] - len(kept)
        to = self.runner.to_device
        drafts.count(to(kept + [False] * pad, torch.bool), to(refused + [False] * pad, torch.bool))

    def _draft(self, seq: Sequence) -> list[int]:
        """The scheduler's drafter: the MTP head's drafts (`edgemoe.engine.mtp`) or prompt lookup, for the sequences
        and steps `_draft_room` allows."""
        k = self._draft_room(seq)
        if k <= 0:
            return []
        if self.mtp is not None:
            return self.mtp.draft(seq, k)
        index = self._ngrams.get(seq)
        if index is None:
            index = self._ngrams[seq] = NgramIndex(self.config.speculative_ngram)
        return index.draft(seq.token_ids, k)

    def _draft_room(self, seq: Sequence) -> int:
        """How many tokens to draft after `seq`'s next one: up to speculative_tokens, within its max_tokens and the
        context; none (0) for a sampled sequence, one a logits processor may change (those that define
        `applies_to`, the grammar's, say which; the others read every sequence, one row a step), or while verify
        steps yield fewer tokens a second than plain ones, and fewer where this sequence's drafts fare too badly for
        more to pay (`SpeculationGate`)."""
        p = seq.params
        if not p.greedy or not self.gate.open():
            return 0
        if any(
            getattr(process, "applies_to", None) is None or process.applies_to(seq)
            for process in self.logits_processors
        ):
            return 0  # a processor that reads this sequence's logits: one row a step
        most = min(self.config.speculative_tokens, p.max_tokens - len(seq.output_ids) - 1,
                   self.max_model_len - len(seq.token_ids) - 1)  # fmt: skip
        return self.gate.drafts(self._acceptance_of(seq), most, len(seq.token_ids))

    def _acceptance_of(self, seq: Sequence) -> Acceptance:
        acceptance = self._acceptance.get(seq)
        if acceptance is None:
            acceptance = self._acceptance[seq] = Acceptance()
        return acceptance

    def _append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        p = seq.params
        stop_token = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if not stop_token:
            before = len(seq.text)
            seq.text += seq.detok.step([token])
            if p.stop:  # a new match must end inside the new delta
                start = max(0, before - max(map(len, p.stop)) + 1)
                hits = [(i, s) for i, s in ((seq.text.find(s, start), s) for s in p.stop) if i >= 0]
                if hits:
                    at, seq.stop_reason = min(hits)
                    seq.text = seq.text[:at]
                    seq.finish_reason = "stop"
                    return
        if stop_token:
            seq.finish_reason = "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
        elif len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"


def _rank_main(config: EngineConfig, rank: int, port: int) -> None:
    """A tensor-parallel worker's process (`edgemoe.engine.parallel`): its engine, quiet, then the forwards rank 0
    sends; one line on the real stderr for whatever stops it."""
    stderr = sys.stderr
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - rank 0 speaks for all ranks
    follow_parent()
    try:
        if config.device == "cuda":  # its own GPU, before NCCL binds one (torch's "cuda" then means it too)
            torch.cuda.set_device(rank)
        join(config, rank, port)
        parallel = TensorParallel(rank, config.tensor_parallel)
        engine = LLMEngine(replace(config, progress=False), parallel=parallel)
        parallel.serve(engine.runner.run_sent)
    except Exception as exc:  # noqa: BLE001 - one line for whatever stopped this rank
        print(f"edgemoe: tensor_parallel rank {rank} stopped: {exc}", file=stderr, flush=True)
        os._exit(1)
