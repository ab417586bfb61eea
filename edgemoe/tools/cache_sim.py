"""`edgemoe cache-sim`: replay a routing trace (`--record-routing`) through the eviction policies and Belady's MIN.

Accesses are the distinct (layer, expert) pairs of each layer-step, in order step by step and layer by layer;
one pool of N slots is shared by all layers. `lru` and `scored` run through `ExpertCache.ensure` itself (the
engine's code, on the CPU); `belady` evicts the resident expert whose next use is furthest away, the upper bound
of any policy on the trace.
"""

from __future__ import annotations

import heapq
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.policies import POLICIES

SIM_POLICIES = (*POLICIES, "belady")


def load_trace(path: str | Path) -> np.ndarray:
    """-> int64 [steps, layers, top_k]."""
    path = Path(path)
    if not path.is_file():
        raise EdgeMoEError(f"routing trace {path} does not exist")
    try:
        trace = np.load(path, allow_pickle=False)
    except ValueError:  # numpy's message for a file that is not .npy talks of pickles and trust
        raise EdgeMoEError(f"{path} is not a routing trace: not a .npy array (`--record-routing` writes one)") from None
    except OSError as exc:
        raise EdgeMoEError(f"cannot read routing trace {path}: {exc}") from None
    if trace.ndim != 3 or not np.issubdtype(trace.dtype, np.integer) or (trace.size and trace.min() < 0):
        raise EdgeMoEError(f"{path} is not a routing trace: expected non-negative integers [steps, layers, top_k]")
    return trace.astype(np.int64)


def synthetic_trace(
    steps: int, layers: int, experts: int, top_k: int, skew: float = 1.0, repeat: float = 0.3, seed: int = 0
) -> np.ndarray:
    """A skewed routing trace, int32 [steps, layers, top_k], for benchmarks on random weights (which route
    almost uniformly). Per layer, expert popularity follows Zipf(`skew`) over a random permutation of the
    experts; each of a token's k picks repeats one of the layer's previous-step experts with probability
    `repeat` (temporal locality, as real routers show), else is drawn by popularity; picks are distinct."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** skew
    popularity /= popularity.sum()
    ranks = [rng.permutation(experts) for _ in range(layers)]  # rank -> expert, per layer
    trace = np.zeros((steps, layers, top_k), dtype=np.int32)
    for s in range(steps):
        for layer in range(layers):
            picks: list[int] = []
            while len(picks) < top_k:
                if s and rng.random() < repeat:
                    e = int(rng.choice(trace[s - 1, layer]))
                else:
                    e = int(ranks[layer][rng.choice(experts, p=popularity)])
                if e not in picks:
                    picks.append(e)
            trace[s, layer] = picks
    return trace


def min_slots(trace: np.ndarray) -> int:
    """The most distinct experts of one layer-step: fewer slots cannot serve the trace."""
    if not trace.size:
        return 1
    s = np.sort(trace, axis=-1)
    return int(1 + (s[..., 1:] != s[..., :-1]).sum(-1).max())


def simulate(trace: np.ndarray, slots: int, policy: str, progress: bool = False) -> dict:
    """Hits and misses of `policy` with `slots` shared slots -> {"hits", "misses", "hit_rate"}."""
    if policy == "belady":
        hits, misses = belady(trace, slots)
    else:
        steps, layers, _ = trace.shape
        cache = ExpertCache(layers, int(trace.max(initial=0)) + 1, slots, policy, "cpu", collect_stats=True)
        ids = torch.from_numpy(trace.astype(np.int64))
        with torch.inference_mode():
            for s in tqdm(range(steps), desc=policy, unit="step", disable=not progress or None, leave=False):
                for layer in range(layers):
                    cache.ensure(layer, ids[s, layer])
        hits, misses = (int(v) for v in cache.stats[:, 1:3].sum(0))
    total = hits + misses
    return {"hits": hits, "misses": misses, "hit_rate": hits / total if total else 0.0}


def belady(trace: np.ndarray, slots: int) -> tuple[int, int]:
    """Belady's MIN over layer-steps: on a miss with the pool full, evict the resident (layer, expert) used
    furthest in the future (never one the current layer-step needs: their next use is now, the earliest)."""
    steps, layers, _ = trace.shape
    accesses = [(t % layers, sorted(set(trace[t // layers, t % layers].tolist()))) for t in range(steps * layers)]
    future: list[list[float]] = [[] for _ in accesses]  # next use after t of each expert accessed at t
    seen: dict[tuple[int, int], float] = {}
    for t in range(len(accesses) - 1, -1, -1):
        layer, experts = accesses[t]
        future[t] = [seen.get((layer, e), math.inf) for e in experts]
        for e in experts:
            seen[layer, e] = t
    resident: dict[tuple[int, int], float] = {}  # key -> its next use
    heap: list[tuple[float, tuple[int, int]]] = []  # (-next use, key), stale entries skipped
    hits = misses = 0
    for t, (layer, experts) in enumerate(accesses):
        for e in experts:
            if (layer, e) in resident:
                hits += 1
                continue
            misses += 1
            if len(resident) >= slots:
                while True:
                    neg, key = heapq.heappop(heap)
                    if resident.get(key) == -neg:
                        del resident[key]
                        break
            resident[layer, e] = t  # used now: the earliest next use, so this step never evicts it
        for e, nxt in zip(experts, future[t]):
            resident[layer, e] = nxt
            heapq.heappush(heap, (-nxt, (layer, e)))
    return hits, misses


def run(trace_path: str | Path, slots: int, policies: list[str], progress: bool = False) -> dict:
    """policy -> {"hits", "misses", "hit_rate"} on the trace at `trace_path`."""
    unknown = [p for p in policies if p not in SIM_POLICIES]
    if unknown or not policies:
        raise EdgeMoEError(f"unknown policy {', '.join(unknown) or '(none)'}: use {', '.join(SIM_POLICIES)}")
    trace = load_trace(trace_path)
    if slots < min_slots(trace):
        raise EdgeMoEError(f"--slots {slots} is too small: one layer-step of this trace needs {min_slots(trace)}")
    return {p: simulate(trace, slots, p, progress) for p in policies}
