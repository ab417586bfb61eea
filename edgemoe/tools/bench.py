"""`edgemoe bench`: offloaded (or, with `--moe-strategy resident`, resident) decode at batch 1 on a synthetic model of a
real geometry (random weights, built in memory), measured against the bound of docs (SYSTEM.md) in the same run:

    t_step >= bytes_read_from_HBM / HBM_bw + bytes_missed / PCIe_bw

HBM bandwidth is a device-to-device copy (bytes read + written), PCIe a pinned host-to-device copy of expert-sized rows,
each measured before the runs and again after them; every bound uses the higher of each pair (a bound is a ceiling:
docs/findings.md, "Bounds use the fastest bandwidth reading"). Random weights route almost uniformly, so
`--routing-trace` can drive the cache instead: a recorded trace (`--record-routing`, .npy [steps, layers, top_k]) or
`synthetic` (`edgemoe.tools.cache_sim.synthetic_trace`: per layer Zipf(1.0) popularity, each pick repeating a
previous-step expert with probability 0.3). Decode runs eager and, where it captures, as one CUDA graph per step (the
same step, replayed). Resident decode keeps every expert on the device as parameters (no cache, no ensure, no miss
copy): its bound is the HBM roofline; its experts hold the same values as the offloaded banks', so both decode the same
tokens.

`--prefill 512,4096` times one prompt of each length through the runner after the engine's start-up warm-up
(`--no-warmup-prefill`: without it): the first prompt of a length (a cold first request) and the median of later ones
(warm), and their ratio.

`--drafts K` (speculative decoding) also times, after each run, verify steps of 1 + K rows (the next position and K
drafted ones, routed by consecutive rows of the trace), and reports the decode rate they give where each draft is
accepted at the rates of `--acceptance` (default 1.0,0.7,0.4): (1 + a + ... + a^K) tokens a step, against plain
decoding's rate in the same run.

`--shared-expert-overlap off,on` runs each configuration with the shared expert inline and on the side stream;
`--profile N` records N replayed graph steps (`edgemoe.tools.profiler`) and reports kernel
counts, busy time, inter-kernel gaps per stream and the side stream's overlap with the miss copy.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from edgemoe.config import ExpertCacheConfig, parse_size, ram_budget
from edgemoe.engine.kv_cache import KVCache
from edgemoe.engine.model_runner import ModelRunner, warmup_lengths
from edgemoe.engine.scheduler import Batch
from edgemoe.engine.sequence import Sequence
from edgemoe.engine.speculative import best_draft_count, expected_tokens
from edgemoe.engine.state_cache import StateCache, stateful_modules
from edgemoe.engine.streams import side_stream
from edgemoe.errors import EdgeMoEError
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.models.dense_store import quantized_buffers
from edgemoe.models.loader import LoadOptions, load_model
from edgemoe.models.registry import FAMILIES
from edgemoe.moe.layer import set_shared_expert_stream
from edgemoe.offload import cpu_split
from edgemoe.offload.banks import TierOptions, ram_rows, replace_ram_tier
from edgemoe.offload.expert_cache import ExpertCache, RefusedDrafts
from edgemoe.offload.experts import MiB, OffloadedExperts, attach_expert_cache, cache_slots, expert_bytes
from edgemoe.offload.ram_tier import read_bandwidth
from edgemoe.quant import QUANT_TYPES
from edgemoe.sampling_params import SamplingParams
from edgemoe.tools.cache_sim import load_trace, synthetic_trace
from edgemoe.tools.measure import bandwidths, capture, plot, profile_lines, run_line, set_bound, settled, timed
from edgemoe.tools.presets import PRESETS
from edgemoe.tools.random_weights import hf_config

PREFILL_REPS = 3  # warm prompts per length (their median is reported)
GEOMETRIES = list(PRESETS)  # real ones fix their family; tiny and small are qwen2_moe (smoke runs)
BLOCK_SIZE = 16


def build_model(
    geometry: str,
    layers: int | None,
    device: torch.device,
    dtype: torch.dtype,
    positions: int = 0,
    resident: bool = False,
    expert_dtype: str = "auto",
    tier: TierOptions | None = None,
) -> MoEForCausalLM:
    """A random-weight model of a named geometry, through the loader (`load_model` without a checkpoint): dense
    weights on `device`, experts in (pinned) host banks, or with `resident` on `device` holding the same values. Its
    RoPE table covers at least `positions` (a benchmark may run a geometry past its trained context). `tier`: the
    experts in an expert store on disk behind a RAM tier (`--ram-budget`)."""
    preset = dict(PRESETS[geometry])
    preset["max_position_embeddings"] = max(preset.get("max_position_embeddings") or 0, positions)
    model_type = preset.pop("family", "qwen2_moe")  # (one family module may read several: qwen3_next)
    family = FAMILIES[model_type]
    cfg = family.normalise(hf_config(model_type, preset, preset["vocab_size"] or 6144, layers))
    host_embedding = not resident and device.type == "cuda"  # as the engine places it
    opts = LoadOptions(device, dtype, False, not resident, expert_dtype, host_embedding=host_embedding, tier=tier)
    return load_model(None, cfg, family, opts)


def make_runner(model: MoEForCausalLM, tokens: int, rows: int = 1) -> ModelRunner:
    """A batch-1 `ModelRunner` over a KV cache of `tokens` positions, whose one sequence's block table is every
    block in order (slot = position), and its state in slot 0 where the model's layers keep one; `rows` decode rows
    (a verify step's: the sequence's next position and its drafted ones)."""
    norm = model.model.norm.weight  # the model's device and dtype (the lm_head may hold GGUF blocks)
    kv = KVCache(model.config, -(-tokens // BLOCK_SIZE), BLOCK_SIZE, norm.dtype, norm.device)
    device = norm.device
    states = StateCache(model, 1, norm.dtype, device) if stateful_modules(model) else None
    return ModelRunner(model, kv, device, rows, kv.num_blocks, states)


def routing(spec: str | None, steps: int, moe_layers: int, experts: int, top_k: int) -> np.ndarray | None:
    if spec is None:
        return None
    if spec == "synthetic":
        return synthetic_trace(steps, moe_layers, experts, top_k, skew=1.0, repeat=0.3, seed=0)
    trace = load_trace(spec)
    if trace.shape[1] < moe_layers or trace.shape[2] != top_k or trace.max() >= experts:
        raise EdgeMoEError(
            f"trace {spec} has shape {list(trace.shape)} (ids < {trace.max() + 1}); the model needs "
            f"[steps, >= {moe_layers}, {top_k}] with ids < {experts}"
        )
    return trace[:, :moe_layers]


class Decoder:
    """Batch-1 decode through the `ModelRunner`'s static decode step, with no host round trip between steps: the next
    token is the argmax and the position advances on the device, and with a trace the routed ids come from its row
    `step` (a device counter) through the routing seam (`ForwardContext.forced_ids`), so a step can be captured.

    `rows` > 1: verify steps of speculative decoding, the sequence's next position and rows - 1 drafted ones, each a
    row attending up to itself (as `ModelRunner.host_inputs` lays a verify step out), routed by consecutive rows of
    the trace (consecutive tokens' experts); each step advances rows positions, as if every draft were accepted."""

    def __init__(self, runner: ModelRunner, context: int, trace: np.ndarray | None, rows: int = 1) -> None:
        self.runner, self.device, self.rows = runner, runner.device, rows
        self.buffers = runner.decode
        table = list(range(runner.kv.num_blocks))
        at = [context + r for r in range(rows)]  # slot = position
        self.buffers.fill([0] * rows, at, at, [p + 1 for p in at], [0] * rows, [table] * rows)
        self.step_ix = torch.arange(rows, dtype=torch.long, device=self.device)
        self.trace = None if trace is None else torch.from_numpy(trace.astype(np.int64)).to(self.device)
        self.step_ids = None  # [layers, rows, top_k]: the step's rows of the trace
        if self.trace is not None:
            self.step_ids = torch.empty(self.trace.shape[1], rows, self.trace.shape[2], dtype=torch.long,
                                        device=self.device)  # fmt: skip

    def step(self) -> None:
        r = self.rows
        if self.trace is not None and r == 1:  # the step's row, once: a lookup per layer added a kernel to every layer
            torch.index_select(self.trace, 0, self.step_ix, out=self.step_ids.view(1, *self.trace.shape[1:]))
        elif self.trace is not None:
            self.step_ids.copy_(self.trace.index_select(0, self.step_ix).transpose(0, 1))
        logits = self.runner.forward_static(r, forced_ids=self.step_ids)
        b = self.buffers
        b.ids[:r].copy_(logits.argmax(-1))
        for t in (b.positions, b.slots, b.context_lens):
            t[:r].add_(r)
        if self.trace is not None:
            self.step_ix.add_(r).remainder_(self.trace.shape[0])


def refused_costs(dec: Decoder, cache: ExpertCache, steps: int) -> list[float]:
    """After a timed run of verify steps, `steps` more, eager and untimed, each recorded as the engine records a
    verify step (`RefusedDrafts`): per m = 0 .. rows - 1, the mean bytes of missed experts that only the rows after
    the m-th draft routed to, were the step to keep m drafts (what refused drafts cost at each outcome)."""
    rows = dec.rows
    top_k = dec.runner.model.config.top_k
    cache.drafts = drafts = RefusedDrafts(cache.num_layers, cache.num_experts, rows, top_k,
                                          cache.expert_bytes, dec.device)  # fmt: skip
    kept = torch.arange(rows, device=dec.device)[None, :] <= torch.arange(rows, device=dec.device)[:, None]  # [m, r]
    total = torch.zeros(rows, dtype=torch.long, device=dec.device)
    try:
        for _ in range(steps):
            drafts.clear()
            dec.step()
            total += torch.stack([drafts.refused(kept[m], ~kept[m]).sum() for m in range(rows)])
    finally:
        cache.drafts = None
    return (total.double() / steps).tolist()


def prewarm(model: MoEForCausalLM, rows: torch.Tensor) -> None:
    """Bring the cache to a steady state before timing: ensure + miss copy of each trace row [layers, top_k], layer
    by layer, without the model (decode reads the trace from its start; these rows come from its end)."""
    layers = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    for row in rows:
        for m in layers:
            m.load(row[m.moe_layer].view(1, -1))


def prefill_lengths(spec: str) -> list[int]:
    try:
        lengths = [int(n) for n in spec.split(",")]
    except ValueError:
        raise EdgeMoEError(f"--prefill {spec!r}: use comma-separated token counts, e.g. 512,4096 (0: skip)") from None
    if min(lengths) < 0:
        raise EdgeMoEError(f"--prefill {spec!r}: token counts must be >= 0")
    return [n for n in lengths if n]


def prefill_runs(runner: ModelRunner, lengths: list[int], warm_up: bool, cache=None, bw: dict | None = None) -> dict:
    """The engine's start-up warm-up (`warmup_lengths` of the longest prompt, every size below it where experts are
    resident, `ModelRunner.warm_up`, the expert cache emptied after it, as `LLMEngine` does), timed; then per length
    a first prompt (the first request after start-up: cold) and PREFILL_REPS more (warm: their median). Offloaded:
    the warm prompts' missed bytes and their PCIe time."""
    device = runner.device
    start = time.perf_counter()
    if warm_up:
        for n in warmup_lengths(max(lengths), cache is None):
            runner.warm_up(n)
        if cache is not None:
            cache.reset()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out = {"warmup_seconds": time.perf_counter() - start if warm_up else None, "runs": []}
    for n in lengths:
        first = prefill(runner, n)
        before = int(cache.stats[:, 4].sum()) if cache is not None else 0
        warm = sorted(prefill(runner, n) for _ in range(PREFILL_REPS))[PREFILL_REPS // 2]
        run = {"tokens": n, "first_seconds": first, "seconds": warm, "tok_s": n / warm, "first_over_warm": first / warm}
        if cache is not None:
            missed = (int(cache.stats[:, 4].sum()) - before) // PREFILL_REPS
            stream = missed / bw["h2d_bytes_per_s"] if bw["h2d_bytes_per_s"] else None
            run |= {"bytes_missed": missed, "pcie_stream_seconds": stream}
            run["pcie_stream_over_time"] = stream / warm if stream else None
        out["runs"].append(run)
        print(
            f"prefill {n} tokens: {run['tok_s']:,.0f} tok/s warm ({warm * 1e3:.1f} ms), first prompt "
            f"{first * 1e3:.1f} ms ({run['first_over_warm']:.2f}x warm)",
            file=sys.stderr,
        )
    return out


def prefill(runner: ModelRunner, tokens: int) -> float:
    """Seconds for one prompt of `tokens` random ids through the runner (the router picks experts; offloaded experts
    are made resident in waves)."""
    ids = torch.randint(runner.model.config.vocab_size, (tokens,)).tolist()
    seq = Sequence(ids, SamplingParams(max_tokens=1), None, None)
    seq.block_table = list(range(-(-tokens // BLOCK_SIZE)))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    runner.compute_logits(Batch([seq], [tokens], True))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_bench(a: argparse.Namespace) -> dict:
    if a.geometry not in GEOMETRIES:
        raise EdgeMoEError(f"unknown geometry {a.geometry!r}; choose from {', '.join(GEOMETRIES)}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EdgeMoEError("edgemoe bench --device cuda needs a CUDA GPU")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[a.dtype]
    print(f"building {a.geometry} ({a.layers or 'all'} layers, {a.dtype}) ...", file=sys.stderr)
    rows = 1 + a.drafts  # a verify step's rows (1: plain decoding only)
    per_run = a.warmup + a.steps + 2 + (a.profile + 4)  # steps one decode() takes
    total_steps = 2 * per_run * rows  # positions: a plain run, and a verify run advancing `rows` a step
    resident = a.moe_strategy == "resident"
    lengths = prefill_lengths(a.prefill)
    positions = max([a.context, *lengths]) + total_steps + 1
    budgets = ram_budgets(a.ram_budget)
    folder = None if a.expert_store is None else Path(a.expert_store).expanduser()
    tier = None if budgets[0] is None else TierOptions(budgets[0][1], folder)
    model = build_model(a.geometry, a.layers, device, dtype, positions, resident, a.expert_dtype, tier)
    cfg = model.config
    tier = next((m.tier for m in model.modules() if isinstance(m, OffloadedExperts)), None)
    if tier is None and budgets[0] is not None:
        raise EdgeMoEError(f"--ram-budget {budgets[0][0]} holds every expert: drop it for that run")
    L, per_expert = sum(cfg.moe_layers), expert_bytes(model, dtype)
    runner = make_runner(model, max([a.context, *lengths]) + total_steps, rows)
    if rows > 1 and runner.states is not None:
        raise EdgeMoEError(f"--drafts: {cfg.model_type} keeps a recurrent state, which speculation does not take yet")
    kv = runner.kv
    tensors = [*model.named_parameters(), *quantized_buffers(model).items()]  # GGUF blocks of dense weights too
    dense = sum(t.numel() * t.element_size() for n, t in tensors if ".experts." not in n)
    embed = getattr(model.model.embed_tokens, "weight", None)  # None: the table is in host memory
    read_embed = embed is not None and not cfg.tie_word_embeddings
    dense_read = dense - (embed.numel() * embed.element_size() if read_embed else 0)
    kv_read = 2 * cfg.num_layers * a.context * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    kv_bytes = 2 * kv.k.numel() * kv.k.element_size()
    bw = bandwidths(device, per_expert)
    if tier is not None:
        print(f"experts on disk: {tier.source.where}; measuring the read rate ...", file=sys.stderr)
        bw |= read_bandwidth(tier.source, cfg.top_k)
        bw["host_rss_after_load"] = host_rss()  # the RAM tier's rows, not the experts
    trace = routing(a.routing_trace, total_steps + a.prewarm, L, cfg.num_experts, cfg.top_k)
    result = {
        "geometry": a.geometry,
        "layers": cfg.num_layers,
        "dtype": a.dtype,
        "context": a.context,
        "expert_bytes": per_expert,
        "expert_dtype": a.expert_dtype,
        "experts": L * cfg.num_experts,
        "dense_bytes": dense,
        **bw,
        "routing": a.routing_trace or "router",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "runs": [],
    }
    if a.moe_strategy == "resident":
        if lengths:
            result["prefill"] = prefill_runs(runner, lengths, a.warmup_prefill)
        decode_runs(result, a, runner, None, trace, L * cfg.num_experts, "resident", bw, dense_read + kv_read)
        return settled(result, device, per_expert)
    sizes = (
        [("moe_cache_fraction", float(f)) for f in a.moe_cache_fraction.split(",")]
        if a.moe_cache_fraction
        else [("vram_budget", v) for v in a.vram_budget.split(",")]
    )
    for (key, value), ram in ((s, r) for s in sizes for r in budgets):
        moe = ExpertCacheConfig(moe_strategy="offload", **{key: value})
        room = None if key != "vram_budget" else parse_size(value) - dense - kv_bytes
        slots = cache_slots(moe, cfg, rows, per_expert, room)
        threads = [int(t) for t in a.moe_cpu_threads.split(",")] if a.moe_cpu_threads else [None]
        runs = [(p, c, t) for p in a.moe_policy.split(",") for c in a.moe_cpu_compute.split(",") for t in threads]
        if ram is not None and tier.rows != ram_rows(ram[1], tier.layers * tier.experts, tier.stride):
            tier = replace_ram_tier(model, ram[1], device.type == "cuda")
        for policy, split, pool in runs:
            if split == "off" and pool != threads[0]:
                continue  # copy-only has no pool: one run
            graphs = device.type == "cuda" and "graph" in a.mode.split(",")
            cache = attach_expert_cache(model, slots, policy, True, device, dtype, split, graphs, cpu_threads=pool)
            if lengths and not result.get("prefill"):
                result["prefill"] = prefill_runs(runner, lengths, a.warmup_prefill, cache, bw)
            label = policy if split == "off" else f"{policy}+cpu:{split}" + ("" if pool is None else f"/{pool}t")
            label += "" if ram is None else f" ram:{ram[0]}"
            decode_runs(result, a, runner, cache, trace, slots, label, bw, dense_read + kv_read)
            if cache.cpu_split is not None:
                cache.cpu_split.close()
            del cache
            model.apply(lambda m: m.attach(None) if isinstance(m, OffloadedExperts) else None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if tier is not None:
        result["host_rss_after_runs"] = host_rss()
    return settled(result, device, per_expert)


def host_rss() -> int | None:
    """This process's resident host memory (VmRSS), None where /proc does not say."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def ram_budgets(spec: str | None) -> list[tuple[str, int | float] | None]:
    """`--ram-budget`'s sweep: (as written, bytes or fraction) each; [None] without one."""
    if not spec:
        return [None]
    return [(b.strip(), ram_budget(b.strip())) for b in spec.split(",")]


def decode_runs(result: dict, a, runner, cache, trace, slots: int, policy: str, bw: dict, fixed_read: int) -> None:
    """`decode` for each shared-expert overlap setting and mode, appended to result["runs"] and printed; with
    `--drafts`, each followed by its verify steps' run (`speculation`)."""
    model, device = runner.model, runner.device
    for overlap in overlaps(a, device, model):
        if device.type == "cuda":
            set_shared_expert_stream(model, side_stream(device.index or 0) if overlap else None)
        for mode in a.mode.split(",") if device.type == "cuda" else ("eager",):
            run = decode(runner, cache, trace, a, mode, slots, policy, bw, fixed_read, result["expert_bytes"])
            if a.drafts and "error" not in run:
                verify = decode(runner, cache, trace, a, mode, slots, policy, bw, fixed_read, result["expert_bytes"],
                                rows=1 + a.drafts)  # fmt: skip
                run["speculation"] = speculation(run, verify, a.drafts, acceptances(a.acceptance))
            result["runs"].append({**run, "shared_expert_overlap": overlap})
            print(run_line(result["runs"][-1]), file=sys.stderr)
            for line in speculation_lines(run.get("speculation")):
                print(line, file=sys.stderr)
            for line in profile_lines(run.get("profile")):
                print(line, file=sys.stderr)


def acceptances(spec: str) -> list[float]:
    try:
        values = [float(v) for v in spec.split(",") if v]
    except ValueError:
        values = []
    if not values or not all(0 <= v <= 1 for v in values):
        raise EdgeMoEError(f"--acceptance {spec!r}: comma-separated rates in [0, 1], e.g. 1.0,0.7,0.4")
    return values


def speculation(plain: dict, verify: dict, drafts: int, rates: list[float]) -> dict:
    """A verify step's time (its `rows` run) against a plain step's, and the decode rate it gives where each draft is
    accepted with probability `rate` given the ones before were: rate^0 + ... + rate^drafts tokens a step. Beside
    it, the count the engine's turn-down would draft (`best_draft_count`, with a drafted row's cost from these two
    steps, as `SpeculationGate.row_cost` measures it) and the rate it models for that count (`turned_down`: a model,
    for a count other than `drafts`, whose verify steps this run did not time)."""
    if "error" in verify:
        return {"drafts": drafts, "error": verify["error"]}
    step, plain_step = 1 / verify["tok_s"], 1 / plain["tok_s"]  # decode() times steps: its tok/s is steps a second
    row_cost = max(step - plain_step, 0.0) / drafts / plain_step
    out = {"drafts": drafts, "verify_step_ms": step * 1e3, "plain_step_ms": plain_step * 1e3, "row_cost": row_cost,
           "verify_miss_bytes_per_step": verify["miss_bytes_per_token"], "at": []}  # fmt: skip
    if_kept = verify.get("refused_bytes_if_kept")  # per m drafts kept: bytes only the refused rows missed
    if if_kept is not None:
        out["refused_bytes_if_kept"] = if_kept
    for rate in rates:
        tokens = expected_tokens(rate, drafts)
        k = best_draft_count(rate, row_cost, drafts)
        turned_down = {"drafts": k, "vs_plain": expected_tokens(rate, k) / (1 + k * row_cost)}
        at = {"acceptance": rate, "tokens_per_step": tokens, "tok_s": tokens / step,
              "vs_plain": tokens / step / plain["tok_s"], "turned_down": turned_down}  # fmt: skip
        if if_kept is not None:  # m drafts kept with probability rate^m (1 - rate), all of them rate^drafts
            chance = [rate**m * (1 - rate) for m in range(drafts)] + [rate**drafts]
            at["refused_bytes_per_step"] = sum(p * b for p, b in zip(chance, if_kept))
        out["at"].append(at)
    return out


def speculation_lines(spec: dict | None) -> list[str]:
    if not spec:
        return []
    if "error" in spec:
        return [f"  verify steps of {spec['drafts']} drafts: {spec['error']}"]
    copied = spec["verify_miss_bytes_per_step"] / MiB
    head = (f"  verify steps of {spec['drafts']} drafts: {spec['verify_step_ms']:.2f} ms against "
            f"{spec['plain_step_ms']:.2f} ms a plain step, {copied:.1f} MiB copied a step")  # fmt: skip
    return [head] + [
        f"    acceptance {r['acceptance']:.2f}: {r['tokens_per_step']:.2f} tokens a step, {r['tok_s']:.1f} tok/s "
        f"({r['vs_plain']:.2f}x plain decoding){refused_text(r)}; turned down: {r['turned_down']['drafts']} drafts, "
        f"{r['turned_down']['vs_plain']:.2f}x (modelled)"
        for r in spec["at"]
    ]


def refused_text(at: dict) -> str:
    got = at.get("refused_bytes_per_step")
    return "" if got is None else f", {got / MiB:.1f} MiB a step missed for refused drafts only"


def overlaps(a: argparse.Namespace, device: torch.device, model: MoEForCausalLM) -> list[bool]:
    """The shared-expert overlap settings to run: only where there is a GPU and a shared expert."""
    wanted = [v == "on" for v in a.shared_expert_overlap.split(",")]
    if device.type != "cuda" or not model.config.shared_expert_intermediate_size:
        return [False]
    return wanted


def profile_steps(step, steps: int) -> dict:
    """`steps` replays of a fresh capture of `step`, recorded and summarised. The recording follows one of a single
    replay, discarded: a first recording once read 10-15 % slow, most likely the profiler's set-up slowing the copy
    service's driver calls (docs/findings.md, "Graph upload policies make no difference")."""
    from edgemoe.tools.profiler import record, summarize

    graph = capture(step)
    graph.replay()  # the first launch
    record(graph.replay, 1)
    return summarize(record(graph.replay, steps), steps)


def decode(
    runner, cache, trace, a, mode: str, slots: int, policy: str, bw: dict, fixed_read: int, per_expert: int,
    rows: int = 1,
) -> dict:  # fmt: skip
    """Decode steps timed (`rows` > 1: verify steps; the figures are a step's: its tok/s is steps a second)."""
    model = runner.model
    dec = Decoder(runner, a.context, trace, rows)
    if dec.device.type == "cuda":
        gc.collect()  # the previous run's graphs
        torch.cuda.reset_peak_memory_stats(dec.device)
        before = torch.cuda.memory_allocated(dec.device)
    run = {
        "slots": slots,
        "fraction": slots / (sum(model.config.moe_layers) * model.config.num_experts),
        "policy": policy,
        "mode": mode,
    }
    try:
        with torch.inference_mode():
            if cache is not None and dec.trace is not None and a.prewarm:
                prewarm(model, dec.trace[-a.prewarm :])
            for _ in range(a.warmup):
                dec.step()
            fn = dec.step
            if mode == "graph":
                fn = capture(dec.step).replay
                split = getattr(cache, "cpu_split", None)
                if split is not None and split.fitted:  # `auto`'s check on replayed steps (it empties the cache)
                    split.check_replayed(fn, cache.reset)
                    if dec.trace is not None and a.prewarm:  # the same warm cache as the other rows
                        prewarm(model, dec.trace[-a.prewarm :])
                    for _ in range(a.warmup):
                        fn()
            fn()
            if cache is not None:
                cache.stats.zero_()
            service = getattr(cache, "copy_service", None)
            served_before = service.host_timings if service is not None else None
            tier = getattr(cache, "tier", None)
            tier_before = tier.stats() if tier is not None else None
            cpu_before = service.cpu_timings if service is not None else None
            seconds = timed(fn, dec.device, a.steps - 1)  # per step; the stats cover its warm call too
            if service is not None:  # what serving the copy lists cost the host, a list (graph runs post)
                run["copy_service"] = service.host_timings.since(served_before)
                lists, ns = (now - then for now, then in zip(service.cpu_timings, cpu_before))
                # lists with CPU pairs (the split's): µs from seeing each to its rows' flag queued
                run["copy_service"].update(cpu_lists=lists, cpu_list_us=ns / lists / 1e3 if lists else None)
            stats = resident_stats(model, dec.trace, a.steps) if cache is None else cache.stats.sum(0).tolist()
            if tier is not None:  # the RAM tier over the same calls
                now = tier.stats()
                run["ram_tier"] = {k: now[k] - tier_before[k] for k in ("accesses", "hits", "reads", "bytes_read",
                                                                         "read_ns")}  # fmt: skip
                run["ram_tier"].update(rows=tier.rows, direct=now["direct"])
            if dec.device.type == "cuda":
                run["peak_vram_bytes"] = torch.cuda.max_memory_allocated(dec.device)
                run["run_vram_bytes"] = run["peak_vram_bytes"] - before  # this run's own peak (graph pool etc.)
            if mode == "graph" and a.profile:
                run["profile"] = profile_steps(dec.step, a.profile)
            if rows > 1 and cache is not None:
                run["refused_bytes_if_kept"] = refused_costs(dec, cache, a.steps)
    except Exception as exc:  # a capture that fails is reported, not fatal
        run["error"] = f"{type(exc).__name__}: {exc}"
        return run
    steps = a.steps  # calls since the stats were zeroed: timed()'s warm call + a.steps - 1 timed ones
    accesses, hits, misses, _, copied, on_cpu = stats
    hbm = fixed_read + accesses / steps * per_expert
    miss_bytes = copied / steps
    if "ram_tier" in run:
        got = run["ram_tier"]
        got["hit_rate"] = got["hits"] / got["accesses"] if got["accesses"] else 0.0
        run["disk_bytes_per_token"] = got["bytes_read"] / steps
    run.update(
        tok_s=1 / seconds,
        hit_rate=hits / accesses if accesses else 0.0,
        misses_per_token=misses / steps,
        cpu_misses_per_token=on_cpu / steps,
        miss_bytes_per_token=miss_bytes,
        hbm_bytes_per_token=hbm,
    )
    split = getattr(cache, "cpu_split", None)
    if split is not None and dec.device.type == "cuda":  # the CPU's rate, for the bound that counts both links
        layer = next(m for m in model.modules() if isinstance(m, OffloadedExperts))
        costs = split.costs or cpu_split.measure(layer, split.pool, dec.device, model.config.top_k)
        run.update(cpu_bytes_per_token=on_cpu / steps * per_expert, cpu_bytes_per_s=per_expert / costs.cpu)
    if bw["hbm_bytes_per_s"]:
        set_bound(run, bw)
    return run


def resident_stats(model: MoEForCausalLM, trace: torch.Tensor | None, steps: int) -> list[float]:
    """The cache's counters (`STAT_FIELDS`: accesses, hits, misses, ...) for resident experts over `steps`
    steps at batch 1: every distinct (layer, expert) of a step is a hit; per step, top_k per MoE layer from the
    router, or the trace's mean distinct experts per row."""
    cfg = model.config
    if trace is None:
        per_step = sum(cfg.moe_layers) * cfg.top_k
    else:
        rows = trace.cpu().numpy()
        per_step = float(np.mean([sum(len(np.unique(layer)) for layer in row) for row in rows]))
    return [steps * per_step, steps * per_step, 0, 0, 0, 0]


def cmd_bench(a: argparse.Namespace) -> None:
    if a.moe_strategy == "resident" and (a.moe_cache_fraction or a.vram_budget):
        raise EdgeMoEError("--moe-strategy resident keeps every expert on the device: drop --moe-cache-fraction and "
                           "--vram-budget")  # fmt: skip
    if a.moe_strategy == "offload" and (a.moe_cache_fraction is None) == (a.vram_budget is None):
        raise EdgeMoEError("give one of --moe-cache-fraction or --vram-budget")
    if a.steps < 2 or min(a.warmup, a.prewarm) < 0 or a.context < 1:
        raise EdgeMoEError("--steps must be >= 2, --warmup and --prewarm >= 0, --context >= 1")
    prefill_lengths(a.prefill)
    for budget in a.vram_budget.split(",") if a.vram_budget else ():
        parse_size(budget)  # one line for a bad size
    if a.ram_budget and a.moe_strategy != "offload":
        raise EdgeMoEError("--ram-budget keeps experts on disk behind RAM: it needs --moe-strategy offload")
    if a.ram_budget and a.moe_cpu_compute != "off":
        raise EdgeMoEError("--moe-cpu-compute computes misses from experts in RAM; with --ram-budget use off")
    if a.expert_store and not a.ram_budget:
        raise EdgeMoEError("--expert-store is where experts beyond --ram-budget go: give --ram-budget too")
    ram_budgets(a.ram_budget)  # one line for a bad budget
    if not set(a.mode.split(",")) <= {"eager", "graph"}:
        raise EdgeMoEError(f"--mode {a.mode!r}: use eager, graph or eager,graph")
    if a.expert_dtype != "auto" and a.expert_dtype.upper() not in QUANT_TYPES:
        raise EdgeMoEError(f"--expert-dtype {a.expert_dtype!r}: use auto or {', '.join(QUANT_TYPES).lower()}")
    if not set(a.shared_expert_overlap.split(",")) <= {"on", "off"}:
        raise EdgeMoEError(f"--shared-expert-overlap {a.shared_expert_overlap!r}: use on, off or off,on")
    if not (isinstance(a.drafts, int) and 0 <= a.drafts <= 64):
        raise EdgeMoEError(f"--drafts {a.drafts!r}: an integer from 0 (none) to 64")
    if a.drafts:
        acceptances(a.acceptance)  # one line for a bad rate
    if a.profile and (a.profile < 2 or "graph" not in a.mode.split(",")):
        raise EdgeMoEError("--profile N needs N >= 2 and --mode with graph (it records replayed graph steps)")
    for split in a.moe_cpu_compute.split(","):
        ExpertCacheConfig(moe_strategy=a.moe_strategy, moe_cpu_compute=split)  # one line for a bad value
    for pool in a.moe_cpu_threads.split(",") if a.moe_cpu_threads else ():
        if not (pool.isdigit() and pool.isascii() and int(pool) >= 1):
            raise EdgeMoEError(f"--moe-cpu-threads {a.moe_cpu_threads!r}: comma-separated integers >= 1")
    if a.dtype not in ("bfloat16", "float16", "float32"):
        raise EdgeMoEError(f"unknown dtype {a.dtype!r}: use bfloat16, float16 or float32")
    result = run_bench(a)
    text = json.dumps(result, indent=1)
    if a.json:
        a.json.write_text(text)
    if a.plot:
        plot(result, a.plot)
    print(text)
