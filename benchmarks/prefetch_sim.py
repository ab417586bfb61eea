"""Would prefetching the next layer's guessed experts reach issue #5's 0.9 of the bound? A timeline model of batch-1
offloaded decode, replayed over a routing trace, before any of it is built.

    python benchmarks/prefetch_sim.py [--fractions 0.25,0.5] [--recalls 0,0.5,0.72,0.9,1] [--json OUT]

The cache is the engine's (`ExpertCache`, CPU path, LRU); time is modelled per MoE layer:
- the layer's work before its experts (norms, attention, router, ensure) takes `--pre-us`; then its miss copies
  queue on PCIe (one link, first come first served), each expert `expert bytes / (h2d x copy efficiency)`, the
  first of a list after `--issue-us`;
- the experts finish `--experts-us` after the router when all hit, else `--expert-us` after the last needed row
  arrives (the GEMV waits per expert, `Arrivals`); then the next layer starts. `--step-us` per step for the rest.
- prefetch (recall r > 0): at its router, layer L also guesses layer L+1's experts (`--guess-us` more) and queues
  copies of the guessed ones not cached, behind its own misses; layer L+1 then waits only for what is still in
  flight (`--prefetch queued`: every guessed expert not cached, behind layer L's misses; `idle`: at most
  `--budget`, only in the time the link would otherwise idle before layer L+1's router, where an unfinished copy
  is finished first if layer L+1 needs it and abandoned otherwise). A guess keeps each of layer L+1's actual
  experts with probability r and replaces the others (`--wrong`: by the layer's popular experts, or uniformly);
  the demo model's next-layer router found r = 0.72 (benchmarks/routing_prediction.py). Guessed experts get their
  slots as layer L+1 (LRU recency), which keeps layer L's experts, the most recent, out of reach.

Reported per cache size: tok/s and its ratio to the bench's serial bound (`--hbm-ms` + the no-prefetch run's miss
bytes over PCIe), PCIe bytes per token, and the share of prefetched experts used before eviction. The trace is
`edgemoe bench`'s synthetic one (qwen3-30b-a3b: 48 layers, 128 experts, top-8) unless `--trace`. The H2D rate and
copy efficiency are the H200's (benchmarks/RESULTS.md); the three compute times were fitted so that the model
without prefetch matches the measured 25 % figure (0.847 of the bound, measured 0.842-0.847), and then predicted
0.817 at 50 % (measured 0.771-0.799): a model a few per cent optimistic, to be read as ratios between its rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from edgemoe.moe.cache_sim import load_trace, synthetic_trace
from edgemoe.moe.expert_cache import ExpertCache


def guesses(trace: np.ndarray, experts: int, recall: float, wrong: str = "popular", seed: int = 0) -> np.ndarray:
    """[steps, layers, k]: per layer-step, each actual expert kept with probability `recall`, else replaced by an
    expert outside the actual set (distinct within the guess), drawn by the layer's popularity in the trace
    (`popular`: a router's near misses are experts it often picks) or uniformly (`uniform`)."""
    rng = np.random.default_rng(seed)
    out = trace.copy()
    for layer in range(trace.shape[1]):
        weight = np.bincount(trace[:, layer].ravel(), minlength=experts).astype(float) + 1e-3
        if wrong == "uniform":
            weight[:] = 1.0
        for s in range(trace.shape[0]):
            actual = trace[s, layer].tolist()
            p = weight.copy()
            p[actual] = 0.0
            keep = rng.random(len(actual)) < recall
            n = int((~keep).sum())
            others = rng.choice(experts, size=n, replace=False, p=p / p.sum()).tolist() if n else []
            out[s, layer] = [e if k else others.pop() for e, k in zip(actual, keep)]
    return out


def simulate(trace: np.ndarray, guess: np.ndarray | None, slots: int, a: argparse.Namespace) -> dict:
    steps, L, _ = trace.shape
    copy_us = a.expert_bytes / (a.h2d_gbs * 1e3 * a.copy_efficiency)  # bytes / (bytes per µs)
    cache = ExpertCache(L, int(trace.max()) + 1, slots, "lru", "cpu", collect_stats=False)
    link = Link(cache, copy_us, a.issue_us)
    warm = steps // 4  # the first quarter fills the cache; timed from there
    t = start = 0.0
    counts = dict.fromkeys(("demand", "prefetched", "used", "abandoned"), 0)
    with torch.inference_mode():
        for s in range(steps):
            if s == warm:
                start, counts = t, dict.fromkeys(counts, 0)
            t += a.step_us
            for layer in range(L):
                router = t + a.pre_us
                needed = set(trace[s, layer].tolist())
                if a.prefetch == "idle":
                    counts["abandoned"] += link.close_window(router, {(layer, e) for e in needed})
                counts["used"] += len({(layer, e) for e in needed} & link.pending)
                link.pending -= {(layer, e) for e in needed}
                got = cache.ensure(layer, torch.tensor(sorted(needed)))
                stale = sorted(e for e in needed if (layer, e) in link.invalid)  # hits on abandoned copies
                counts["demand"] += link.queue(layer, got.src[: int(got.count)].tolist() + stale, router)
                last = max(link.arrive.get((layer, e), 0.0) for e in needed)
                end = max(router + a.experts_us, last + a.expert_us)
                if guess is not None and layer + 1 < L:
                    end += a.guess_us
                    counts["prefetched"] += prefetch(cache, link, layer + 1, guess[s, layer + 1], router, a)
                t = end
    timed_steps = steps - warm
    step_us = (t - start) / timed_steps
    copies = counts["demand"] + counts["prefetched"]
    return {
        "step_ms": step_us / 1e3,
        "tok_s": 1e6 / step_us,
        "demand_misses_per_token": counts["demand"] / timed_steps,
        "prefetches_per_token": counts["prefetched"] / timed_steps,
        "prefetches_used_share": counts["used"] / counts["prefetched"] if counts["prefetched"] else None,
        "prefetches_abandoned_share": counts["abandoned"] / counts["prefetched"] if counts["prefetched"] else None,
        "pcie_mib_per_token_upper": copies * a.expert_bytes / timed_steps / 2**20,
    }


def prefetch(cache: ExpertCache, link: Link, layer: int, guess: np.ndarray, issued: float, a) -> int:
    """Give slots to the guessed experts of `layer` not cached (at most `--budget` of them in idle mode) and start
    their copies. -> how many."""
    table = cache.slot_table()
    wanted = [e for e in dict.fromkeys(guess.tolist()) if table[layer, e] < 0]
    if a.prefetch == "idle":
        wanted = wanted[: a.budget]
    if not wanted:
        return 0
    got = cache.ensure(layer, torch.tensor(sorted(wanted)))
    experts = got.src[: int(got.count)].tolist()
    if a.prefetch == "idle":
        link.open_window(layer, experts, issued)
    else:
        link.queue(layer, experts, issued)
    link.pending |= {(layer, e) for e in experts}
    return len(experts)


class Link:
    """PCIe: demand copies in one first-come-first-served queue; in idle mode, prefetches only in the time the
    link would idle until the next layer's router, and stopped there (chunk by chunk: a copy the next layer needs
    finishes first, any other is abandoned and its slot holds nothing usable)."""

    def __init__(self, cache: ExpertCache, copy_us: float, issue_us: float) -> None:
        self.cache, self.copy_us, self.issue_us = cache, copy_us, issue_us
        self.free = 0.0  # when the link finishes the demand copies queued
        self.arrive: dict[tuple[int, int], float] = {}  # when each cached expert's rows are in
        self.pending: set[tuple[int, int]] = set()  # prefetched, not yet used
        self.invalid: set[tuple[int, int]] = set()  # cached, but the copy was abandoned
        self.window: tuple[int, list[int], float] | None = None  # (layer, experts, start) of idle prefetches

    def queue(self, layer: int, experts: list[int], issued: float) -> int:
        for e in experts:
            self.free = max(self.free, issued + self.issue_us) + self.copy_us
            self.arrive[layer, e] = self.free
            self.invalid.discard((layer, e))
        self._forget_evicted()
        return len(experts)

    def open_window(self, layer: int, experts: list[int], issued: float) -> None:
        self.window = (layer, experts, max(self.free, issued + self.issue_us))
        for e in experts:
            self.arrive[layer, e] = float("inf")  # until the window closes
        self._forget_evicted()

    def close_window(self, now: float, needed: set[tuple[int, int]]) -> int:
        """The next layer's router at `now`: settle the idle prefetches. -> how many were abandoned."""
        if self.window is None:
            return 0
        layer, experts, cursor = self.window
        self.window, abandoned = None, 0
        for e in experts:
            key = (layer, e)
            if key not in self.arrive:
                continue  # evicted meanwhile
            if cursor + self.copy_us <= now:
                cursor += self.copy_us
                self.arrive[key] = cursor
            elif key in needed:  # the rest of its copy heads the demand queue
                done = max(0.0, now - cursor)
                self.free = max(self.free, now) + self.copy_us - done
                self.arrive[key] = self.free
                cursor = now
            else:
                del self.arrive[key]
                self.invalid.add(key)
                self.pending.discard(key)
                abandoned += 1
                cursor = max(cursor, now)
        return abandoned

    def _forget_evicted(self) -> None:
        table = self.cache.slot_table()
        for key in [k for k in self.arrive if table[k] < 0]:
            del self.arrive[key]
            self.pending.discard(key)
        self.invalid = {k for k in self.invalid if table[k] >= 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", help="a recorded routing trace (.npy); default: the bench's synthetic qwen3 trace")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--fractions", default="0.25,0.5")
    p.add_argument("--recalls", default="0,0.5,0.72,0.9,1")
    p.add_argument("--expert-bytes", type=int, default=3 * 2048 * 768 * 2)
    p.add_argument("--h2d-gbs", type=float, default=55.0)
    p.add_argument("--copy-efficiency", type=float, default=0.89, help="the SM copy's share of memcpy")
    p.add_argument("--issue-us", type=float, default=0.0, help="from a list's post to its first copy")
    p.add_argument("--pre-us", type=float, default=45.0)
    p.add_argument("--experts-us", type=float, default=9.0)
    p.add_argument("--expert-us", type=float, default=15.0)
    p.add_argument("--guess-us", type=float, default=2.0)
    p.add_argument("--prefetch", choices=["queued", "idle"], default="idle")
    p.add_argument("--wrong", choices=["popular", "uniform"], default="popular", help="how wrong guesses are drawn")
    p.add_argument("--budget", type=int, default=1, help="idle mode: prefetches a layer at most")
    p.add_argument("--step-us", type=float, default=100.0)
    p.add_argument("--hbm-ms", type=float, default=1.52, help="the bound's HBM term (1 / roofline tok/s)")
    p.add_argument("--json")
    a = p.parse_args()
    trace = load_trace(a.trace) if a.trace else synthetic_trace(a.steps, 48, 128, 8, skew=1.0, repeat=0.3, seed=0)
    steps, L, k = trace.shape
    E = int(trace.max()) + 1
    results = []
    for fraction in (float(f) for f in a.fractions.split(",")):
        slots = round(fraction * L * E)
        base = None
        for recall in (float(r) for r in a.recalls.split(",")):
            guess = None if recall == 0 else guesses(trace, E, recall, a.wrong)
            run = {"fraction": fraction, "slots": slots, "recall": recall, **simulate(trace, guess, slots, a)}
            if base is None:
                base = run
            bound_ms = a.hbm_ms + base["demand_misses_per_token"] * a.expert_bytes / (a.h2d_gbs * 1e6)
            run["bound_tok_s"] = 1e3 / bound_ms
            run["over_bound"] = run["tok_s"] / run["bound_tok_s"]
            results.append(run)
            print(
                f"{fraction:.0%} cached, recall {recall:.2f}: {run['tok_s']:.1f} tok/s, {run['over_bound']:.3f} of "
                f"the bound ({run['bound_tok_s']:.1f}), "
                f"{run['demand_misses_per_token']:.1f} misses + {run['prefetches_per_token']:.1f} prefetches a token",
                file=sys.stderr,
            )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
