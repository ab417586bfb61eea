"""The CPU split (issue #34): of a decode step's missed experts, some are computed on the host (`CpuExperts`, from the
layer's host bank) while the others are copied over PCIe, so a layer that misses much waits for the slower of the
two instead of for every copy.

The split is a table on the device, `table[m]` = how many of a layer-step's m misses go to the CPU, read by `ensure`
without a host sync (`ExpertCache._ensure_torch` says which misses and how the policy and stats count them). A CPU
pair has no slot (`slots` -1); the expert kernels take its unweighted output, fp32, from a [pairs, hidden] buffer
instead of computing it, and weight and sum every pair in their usual order (`ExpertLayout.decode_cpu`).

Two ways the rows are made, the same arithmetic (the same executor, the same sum):
- replayed decode graphs: the captured `ensure` posts the step's CPU misses, routed ids and x to the copy service's
  mailbox with its copy list (`edgemoe.kernels.protocol`); the thread that replayed the graph computes them once the
  copies are queued, copies the rows to the device and sets a flag the expert kernels wait on (`copy_service.c`). No
  host sync inside the step.
- eager steps: the host reads the step's CPU pairs right after `ensure` (a sync, `CpuSplit.pairs`), computes them
  while the GPU copies the rest, and uploads the rows.

`--moe-cpu-compute`: `off`; N, at most N misses a layer-step (experiments); `auto`, the table fitted to costs
measured at start-up (`measure`, CUDA): copy time per expert c, CPU time per expert p, a fixed cost per layer-step o,
each taken while the other runs (both read host memory); of m misses n go to the CPU, the n that minimises
max(c (m - n), o + p n), and none unless that is strictly below c m (`fit`). o is what a split step pays beyond its
pairs: with graphs, the mailbox round trip (a posted list with one CPU pair against one with none, replayed), else the
eager sync and row transfers. A last check times steps split against copied and turns the split off unless it wins:
with graphs, replayed decode steps that miss every expert and steps that hit every expert, with the table as fitted
and zeroed (the table is a device tensor: no recapture; `check_replayed`, once the engine has captured its graphs),
else `split_wins`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.offload.cpu_experts import CpuExperts, layout_formats
from edgemoe.offload.layout import ExpertLayout

if TYPE_CHECKING:
    from edgemoe.offload.copy_service import CopyService

HIT_TOLERANCE = 0.05  # `check_replayed`: what a split may add to a step missing nothing (noise; q4_k's added ~1 ms)
# `check_replayed`: what a split must save on a step missing every expert to be kept. Its fp32 sums round otherwise
# than the GPU's, so where the two are within timing noise the bitwise copy-only path stays (on the H100 a tiny
# checkpoint's split won by 0.3 %, 0.192 ms against 0.195, and its logits then moved against the eager run's).
MISS_GAIN = 0.02


@dataclass(frozen=True)
class Costs:
    """What one layer-step's misses cost, in seconds (`measure`)."""

    copy: float  # per expert copied host -> device
    cpu: float  # per expert computed on the CPU
    overhead: float  # per layer-step that computes any expert on the CPU


def fit(costs: Costs, max_misses: int, cap: int | None = None) -> list[int]:
    """table[m], m = 0..max_misses: the CPU's share n <= min(m, cap) of m misses that minimises
    max(copy (m - n), overhead + cpu n); 0 unless strictly faster than copying all m (ties: the fewer on the CPU)."""
    table = [0]
    for m in range(1, max_misses + 1):
        best, best_t = 0, costs.copy * m
        for n in range(1, min(m, max_misses if cap is None else cap) + 1):
            t = max(costs.copy * (m - n), costs.overhead + costs.cpu * n)
            if t < best_t:
                best, best_t = n, t
        table.append(best)
    return table


class CpuSplit:
    """The split table (`table` [max_misses + 1] int32 on `device`) and the pool that computes the CPU's pairs; with
    a copy service (CUDA), the pool is attached to it for replayed steps. `fitted`: an `auto` table whose check on
    replayed steps is still due (`check_replayed`). `costs`: what `auto` measured (None for a manual N)."""

    def __init__(
        self, table: list[int], pool: CpuExperts, device: torch.device, service: CopyService | None = None,
        fitted: bool = False, costs: Costs | None = None,
    ) -> None:  # fmt: skip
        self.table = torch.tensor(table, dtype=torch.int32, device=device)
        self.pool, self.service, self.fitted, self.costs = pool, service, fitted, costs

    def pairs(self, ids: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The step's CPU pairs on the host (a sync): (pair index, token, expert) int64 [P] and x fp32 [T, H]; None
        without any."""
        flat = slots.reshape(-1).cpu()
        pairs = (flat < 0).nonzero()[:, 0]
        if not pairs.numel():
            return None
        top_k = ids.shape[-1]
        return pairs, pairs // top_k, ids.reshape(-1).cpu()[pairs], x.detach().float().cpu().contiguous()

    def compute(
        self, bank: torch.Tensor, layout: ExpertLayout, pairs: tuple[torch.Tensor, ...], total: int,
        device: torch.device, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[total, H] fp32 on `device`: each CPU pair's unweighted output in its row (zeros elsewhere); `biases`: the
        layer's expert biases (`OffloadedExperts.host_biases`)."""
        index, tokens, experts, x = pairs
        y = self.pool.compute(bank, layout, x, tokens, experts, torch.empty(len(index), layout.hidden), biases)
        out = torch.zeros(total, layout.hidden)
        out[index] = y
        return out.to(device)

    def check_replayed(self, step: Callable[[], object], reset: Callable[[], None], rounds: int = 7) -> bool:
        """Time replayed decode steps (`step`) copy-only (the table zeroed) and split (as fitted), each where it
        misses every expert (`reset` empties the cache first) and where it hits every expert (the same step again
        once copy-only has made its experts resident), alternately; keep the table only if the split saves at least
        `MISS_GAIN` on missing steps and costs at most `HIT_TOLERANCE` more on hitting ones (else zero it), and say
        which.

        Why both: the table sends a layer-step's misses to the CPU only from a fitted count on, so fewer misses than
        that pay only what the split adds to every step (docs/findings.md, "CPU split"); the hitting step measures
        that cost, the missing step the
        gain. Between the two a step pays at most the one and gains at most the other. -> whether the split stays
        on."""
        fitted, zeros = self.table.clone(), torch.zeros_like(self.table)
        times: dict[str, list[float]] = {"copy-only miss": [], "copy-only hit": [], "split hit": [], "split miss": []}

        def timed(name: str, table: torch.Tensor, empty: bool) -> None:
            self.table.copy_(table)
            if empty:
                reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)

        for _ in range(rounds):  # copy-only's missing step makes the hitting steps' experts resident
            timed("copy-only miss", zeros, True)
            timed("copy-only hit", zeros, False)
            timed("split hit", fitted, False)
            timed("split miss", fitted, True)
        t = {name: _median(ts) for name, ts in times.items()}
        keep = (t["split miss"] < t["copy-only miss"] * (1 - MISS_GAIN)
                and t["split hit"] <= t["copy-only hit"] * (1 + HIT_TOLERANCE))  # fmt: skip
        self.table.copy_(fitted if keep else zeros)
        self.fitted = False
        verdict = "keeps the split" if keep else "turns the split off"
        _say(f"replayed steps missing every expert: copy-only {t['copy-only miss'] * 1e3:.3f} ms, split "
             f"{t['split miss'] * 1e3:.3f} ms; hitting every expert: copy-only {t['copy-only hit'] * 1e3:.3f} ms, "
             f"split {t['split hit'] * 1e3:.3f} ms -> {verdict}")  # fmt: skip
        return keep

    def close(self) -> None:
        if self.service is not None:
            self.service.detach_cpu()
        self.pool.close()


def manual_table(cap: int, max_misses: int) -> list[int]:
    """`--moe-cpu-compute N`: min(m, N) of m misses on the CPU."""
    return [min(m, cap) for m in range(max_misses + 1)]


def resolve(
    setting: str | int, layers: list, device: torch.device, top_k: int, graphs: bool, threads: int | None = None,
    service: CopyService | None = None, max_tokens: int = 1,
) -> CpuSplit | None:  # fmt: skip
    """The split `--moe-cpu-compute` asks for over offloaded layers `layers` (`OffloadedExperts`, in MoE-layer order),
    or None for none; a line to stderr says what was chosen. `top_k`: a token's misses at most (the step `auto`
    checks); `graphs`: decode would replay CUDA graphs (what `auto` measures: the mailbox round trip; its last check
    then waits for the graphs, `CpuSplit.check_replayed`); `service`: the cache's copy service, which computes the
    pairs of replayed steps (steps of at most `max_tokens` tokens)."""
    setting = str(setting)
    if setting == "off" or not layers:
        return None
    layout, experts = layers[0].layout, layers[0].num_experts
    why = unsupported(layers[0])
    if why is not None:  # auto leaves the split off, a number asks for what cannot be
        if setting == "auto":
            _say(f"off: {why}")
            return None
        raise EdgeMoEError(f"moe_cpu_compute {setting}: {why}")
    if setting == "auto" and device.type != "cuda":  # the CPU device copies nothing over PCIe to weigh against
        return None
    # a CPU device's own work runs on torch's threads, which spin between ops and starve a second pool (measured on
    # 2 cores: a job 200x slower), so there the calling thread computes alone
    pool = CpuExperts(1 if device.type == "cpu" and threads is None else threads)
    if service is not None:
        service.attach_cpu(pool, [(m.bank, m.layout, m.host_biases()) for m in layers], max_tokens)
    if setting != "auto":
        cap = int(setting)
        _say(f"{pool.threads} threads ({pool.isa}), at most {cap} misses a layer-step on the CPU (manual)")
        return CpuSplit(manual_table(cap, experts), pool, device, service)
    _say(f"measuring the CPU against the copy ({pool.threads} threads, {pool.isa}) ...")
    costs = measure(layers[0], pool, device, top_k, service=service if graphs else None)
    table = fit(costs, experts)
    if any(table) and not graphs and not split_wins(layers[0], pool, device, top_k, table[top_k]):
        table = [0] * len(table)
    what = _describe(table) + (" (checked on replayed steps once captured)" if graphs and any(table) else "")
    per_step = "mailbox round trip" if graphs else "layer-step"
    _say(
        f"{layout.dtype if type(layout) is ExpertLayout else 'quantized'} experts: cpu {costs.cpu * 1e3:.3f} ms, copy "
        f"{costs.copy * 1e3:.3f} ms an expert, {costs.overhead * 1e3:.3f} ms a {per_step} -> {what}"
    )
    if not any(table):
        if service is not None:
            service.detach_cpu()
        pool.close()
        return None
    return CpuSplit(table, pool, device, service, fitted=graphs, costs=costs)


def unsupported(layer) -> str | None:  # noqa: ANN001 - an OffloadedExperts
    """Why the CPU expert executor cannot compute `layer`'s experts (an activation or layout it lacks), or None."""
    try:
        layout_formats(layer.layout)
    except EdgeMoEError as exc:
        return str(exc)
    return None


def _describe(table: list[int]) -> str:
    if not any(table):
        return "none on the CPU (copy-only is faster)"
    first = next(m for m, n in enumerate(table) if n)
    last = len(table) - 1
    return f"from {first} misses a layer-step on: {table[first]} of {first} ... {table[last]} of {last} on the CPU"


def _say(text: str) -> None:
    print(f"edgemoe: cpu experts: {text}", file=sys.stderr)


# ---- measurement (CUDA) ----


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def _copy_rows(layer, pool_row: torch.Tensor, experts: range) -> None:
    for e in experts:
        pool_row.copy_(layer.bank[e], non_blocking=True)


def _fresh(layer, n: int, r: int) -> torch.Tensor:
    """n experts of the bank, others each round, so that the CPU reads them from memory as a miss does, not from
    its last-level cache."""
    return (torch.arange(n) + r * n) % layer.num_experts


def measure(
    layer, pool: CpuExperts, device: torch.device, top_k: int, rounds: int = 5, service: CopyService | None = None
) -> Costs:
    """Per-expert copy and CPU times and the per-layer-step cost, each taken while the other runs (both read host
    memory): copies of a layer's bank rows into a scratch row, the pool on one pair an expert, and the eager split's
    sync and row transfers, or with a copy service (graphs) its round trip (`round_trip`). A few seconds at most."""
    experts = min(8, layer.num_experts)
    scratch = torch.empty(layer.layout.row, dtype=layer.layout.dtype, device=device)
    x = torch.randn(1, layer.layout.hidden)
    cpu_times, copy_times = [], []
    for n in (1, experts):
        tokens = torch.zeros(n, dtype=torch.long)
        out = torch.empty(n, layer.layout.hidden)
        for r in range(rounds):
            ids = _fresh(layer, n, r)
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _copy_rows(layer, scratch, range(experts))
            end.record()
            t0 = time.perf_counter()
            pool.compute(layer.bank, layer.layout, x, tokens, ids, out, layer.host_biases())
            cpu_times.append((n, time.perf_counter() - t0))
            end.synchronize()
            copy_times.append(start.elapsed_time(end) / 1e3 / experts)
    one = _median([t for n, t in cpu_times if n == 1])
    many = _median([t for n, t in cpu_times if n == experts])
    per_expert = (many - one) / (experts - 1) if experts > 1 else one
    fixed = max(one - per_expert, 0.0)
    if service is not None:  # one CPU pair's round trip holds the pool's fixed cost and one expert's
        overhead = max(round_trip(service, layer, rounds) - per_expert, fixed)
        return Costs(copy=_median(copy_times), cpu=max(per_expert, 1e-9), overhead=overhead)
    rows = torch.empty(top_k, layer.layout.hidden, device=device)
    sync = []
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        host = rows.float().cpu()
        rows.copy_(host.to(device))
        torch.cuda.synchronize(device)
        sync.append(time.perf_counter() - t0)
    return Costs(copy=_median(copy_times), cpu=max(per_expert, 1e-9), overhead=fixed + _median(sync))


def split_wins(layer, pool: CpuExperts, device: torch.device, misses: int, on_cpu: int, rounds: int = 5) -> bool:
    """Whether a layer-step of `misses` misses with `on_cpu` of them on the CPU ends sooner than copying them all,
    as timed here (copies into a scratch row, the pool, the eager split's transfers)."""
    scratch = torch.empty(layer.layout.row, dtype=layer.layout.dtype, device=device)
    x = torch.randn(1, layer.layout.hidden, device=device)
    tokens, out = torch.zeros(on_cpu, dtype=torch.long), torch.empty(on_cpu, layer.layout.hidden)

    def step(n: int, r: int) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        xh = x.float().cpu()
        _copy_rows(layer, scratch, range(misses - n))
        if n:
            pool.compute(layer.bank, layer.layout, xh, tokens, _fresh(layer, n, r), out, layer.host_biases())
            x.copy_(out[:1].to(device))
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    copy_only = _median([step(0, r) for r in range(rounds)])
    split = _median([step(on_cpu, r) for r in range(rounds)])
    return split < copy_only


def round_trip(service: CopyService, layer, rounds: int = 5) -> float:
    """Seconds a replayed list with one CPU pair (MoE layer 0's `layer`) takes beyond one with none: the post with
    its x, the serving thread's pass over it, the executor, the row's copy and flag, the GPU's wait. A small graph of
    the probe's post and the wait, replayed with the pair's count set on the device to 1 and to 0 alternately."""
    from edgemoe.kernels.miss_copy import await_cpu_rows, post_cpu_probe

    device = service.tick.device
    expert = torch.zeros(1, dtype=torch.long, device=device)
    x = torch.randn(1, layer.layout.hidden, device=device)
    count = torch.ones((), dtype=torch.long, device=device)
    target = service.target(layer.banks)

    def probe() -> None:
        post_cpu_probe(target, expert, x, count)
        await_cpu_rows(service.cpu_wait(count))

    probe()  # compiled, and served, eagerly first
    service.serve()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probe()
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(2 * rounds):
        for n in (0, 1):
            count.fill_(n)
            expert.fill_(r % layer.num_experts)  # another expert each round: read from memory, as a miss is
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            graph.replay()
            service.serve()
            times[n].append(time.perf_counter() - t0)
    return max(_median(times[1]) - _median(times[0]), 0.0)
