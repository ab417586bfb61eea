"""Kernel timelines of replayed decode steps (`edgemoe bench --profile`): torch.profiler (CUPTI) records every GPU
operation of N steps, and `summarize` turns them into per-step figures (kernel count, kernel busy time, GPU time,
tok/s), per-stream gaps between consecutive kernels, how much of the side stream's work ran while the miss
copy was in flight, and what the link does around each copy list the copy service serves.

Steps are told apart on the stream with the most kernels, where every step launches the same operations: its
operations cut every `len / steps` give each step's start, and every other operation belongs to the step begun
last before it starts (a step's side-stream work is joined before the step ends; the copy service's memcpys, on a
stream of their own, vary with the misses).
"""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
MISS_COPY = "_copy_rows"  # the miss-copy kernel's name (edgemoe.kernels.miss_copy)
# the expert cache's `ensure` and the routed experts' up and down GEMVs (edgemoe.kernels)
ENSURE, UP, DOWN = "_ensure", "_up", "_down"


@dataclass(frozen=True)
class GpuOp:
    name: str
    stream: int
    start: int  # ns
    end: int  # ns
    kernel: bool  # False: a memcpy or memset
    nbytes: int = 0  # a memcpy's bytes, where the trace gives them


def record(fn: Callable[[], object], steps: int) -> list[GpuOp]:
    """Run `fn` `steps` times under torch.profiler; every GPU operation, sorted by start. Read from the exported
    Chrome trace (its `cat`, `ts`/`dur` in µs with ns decimals, `args.stream`), which every torch version writes
    alike."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return ops_from_chrome_trace(events)


def ops_from_chrome_trace(events: list[dict]) -> list[GpuOp]:
    ops = []
    for e in events:
        if e.get("cat") in GPU_ACTIVITIES and e.get("ph") == "X":
            start = round(float(e["ts"]) * 1000)
            stream = int(e.get("args", {}).get("stream", e.get("tid", 0)))
            end, nbytes = start + round(float(e["dur"]) * 1000), int(e.get("args", {}).get("bytes", 0))
            ops.append(GpuOp(e["name"], stream, start, end, e["cat"] == "kernel", nbytes))
    return sorted(ops, key=lambda o: (o.start, o.end))


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(start: int, end: int, union: list[tuple[int, int]]) -> int:
    """Length of [start, end) inside the (sorted, disjoint) `union`."""
    return sum(max(0, min(end, b) - max(start, a)) for a, b in union if a < end and b > start)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _is_copy(op: GpuOp, main: int, copy_kernel: str) -> bool:
    """The miss copy: the SM copy's kernel, or a memcpy off the main stream (the copy service's)."""
    return copy_kernel in op.name or (not op.kernel and op.stream != main)


def _parallel_branch(step: list[GpuOp], main: int, copy_kernel: str) -> list[GpuOp]:
    """The kernels of one step that run beside the routed experts' branch (the shared expert's).

    Eager: the routed branch (miss copy included) runs inline on the busiest stream and the shared expert on the
    side stream, so: everything off the busiest stream. Graph replay: the driver gives each layer's forked branches
    streams of its own, and the routed branch may be the one moved off the launch stream. Then the shared branch is
    what runs on streams without a miss copy while a copy-carrying stream is busy: serial work before a fork ends
    before the branch starts, and work after a join starts after it ends."""
    step = [o for o in step if o.kernel or o.stream == main]  # the copy service's memcpys are no branch
    copy_streams = {o.stream for o in step if copy_kernel in o.name}
    if not copy_streams or main in copy_streams:
        return [o for o in step if o.stream != main and o.kernel]
    windows = [
        (min(o.start for o in step if o.stream == s), max(o.end for o in step if o.stream == s)) for s in copy_streams
    ]
    return [o for o in step if o.stream not in copy_streams and any(o.start < b and o.end > a for a, b in windows)]


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list, at most 60 characters."""
    for cut in ("<", "("):
        if cut in name and not name.startswith(cut):
            name = name[: name.index(cut)]
    return name[:60]


def _top_ops(ops: list[GpuOp], steps: int, n: int = 12) -> list[dict]:
    """The n operation names with the most time per step: name, count, µs per step, and `extends_us`: by how much
    they pushed their stream's last end forward (end - max(start, the latest end of the stream's earlier
    operations)), per step. Under PDL a kernel starts while the one before it runs and waits for it, so its own
    duration counts that wait; what it adds to its stream's timeline is its cost on a serial stream."""
    total: dict[str, list[float]] = {}
    last_end: dict[int, int] = {}
    for o in ops:  # sorted by start
        entry = total.setdefault(_short(o.name), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += o.end - o.start
        reach = last_end.get(o.stream, o.start)
        entry[2] += max(0, o.end - max(o.start, reach))
        last_end[o.stream] = max(reach, o.end)
    ranked = sorted(total.items(), key=lambda kv: -kv[1][1])[:n]
    return [
        {"name": k, "count": v[0] / steps, "us": v[1] / steps / 1e3, "extends_us": v[2] / steps / 1e3}
        for k, v in ranked
    ]


def _steps(ops: list[GpuOp], starts: list[int]) -> list[list[GpuOp]]:
    """`ops` cut into steps at `starts` (each step's first start on the busiest stream): an operation belongs to the
    last step begun by its start, those before the first to the first. Other streams may carry a different number
    of operations each step (the copy service's memcpys follow the misses)."""
    chunks: list[list[GpuOp]] = [[] for _ in starts]
    for o in ops:
        chunks[max(0, bisect.bisect_right(starts, o.start) - 1)].append(o)
    return chunks


def _copy_lists(chunks: list[list[GpuOp]], main: int) -> dict | None:
    """The link around each copy list the copy service served (memcpys off the main stream), in replayed offloaded
    decode steps. A layer's list is the memcpys that start from its `ensure`'s inputs being ready (the end of the
    kernel before it on its stream, the router; where a graph forks the routed branch onto a stream of its own, as
    with a shared expert beside it, that is the branch stream's previous kernel, and the delays read long) to the
    next layer's. Medians over the lists (p90 for the first byte) of: `first_byte_us`, from ready to the first
    copy's start (ensure up to its post, the post reaching the host, the host's copy call, the copy engine's
    start); `ensure_us`, from ready to ensure's end; `copies`; `gaps_us`, the link's idle time between the list's
    first copy start and last copy end; `tail_us` and `up_tail_us`, from the last copy's end to the end of the
    layer's (last) down and up GEMV; per step: `lists`, `link_busy_us` (the union of copies), `link_idle_us` (the
    rest of the step) and `gbs` (bytes over busy time, where the trace gives bytes). None when no list was
    served."""
    lists, per_step, busy, idle, nbytes = [], [], [], [], 0
    for step in chunks:
        streams: dict[int, list[GpuOp]] = {}
        for o in step:
            if o.kernel:
                streams.setdefault(o.stream, []).append(o)
        layers = []  # (ready, ensure, down or None, up or None)
        for ks in streams.values():
            for i, k in enumerate(ks):
                if _short(k.name).startswith(ENSURE):
                    layer = list(itertools.takewhile(lambda o: not _short(o.name).startswith(ENSURE), ks[i + 1 :]))
                    # the layer's last down and up (one of each in the engine; a variant may split them)
                    down = next((d for d in reversed(layer) if _short(d.name).startswith(DOWN)), None)
                    up = next((u for u in reversed(layer) if _short(u.name).startswith(UP)), None)
                    layers.append((ks[i - 1].end if i else k.start, k, down, up))
        layers.sort(key=lambda x: x[0])
        copies = sorted((o for o in step if not o.kernel and o.stream != main), key=lambda o: o.start)
        bounds = [ready for ready, *_ in layers[1:]] + [float("inf")] * bool(layers)
        n = 0
        for (ready, ensure, down, up), until in zip(layers, bounds, strict=True):
            mine = [c for c in copies if ready <= c.start < until]
            if not mine:
                continue
            n += 1
            spent = sum(c.end - c.start for c in mine)
            lists.append(
                {
                    "first_byte_us": (mine[0].start - ready) / 1e3,
                    "ensure_us": (ensure.end - ready) / 1e3,
                    "copies": len(mine),
                    "gaps_us": (max(c.end for c in mine) - mine[0].start - spent) / 1e3,
                    "tail_us": None if down is None else (down.end - max(c.end for c in mine)) / 1e3,
                    "up_tail_us": None if up is None else (up.end - max(c.end for c in mine)) / 1e3,
                }
            )
        per_step.append(n)
        link = sum(b - a for a, b in _union([(c.start, c.end) for c in copies]))
        busy.append(link)
        idle.append(max(o.end for o in step) - step[0].start - link)
        nbytes += sum(c.nbytes for c in copies)
    if not lists:
        return None

    def med(key: str) -> float | None:
        values = [x[key] for x in lists if x[key] is not None]
        return statistics.median(values) if values else None

    return {
        "lists": statistics.median(per_step),
        "first_byte_us": med("first_byte_us"),
        "first_byte_p90_us": _quantile([x["first_byte_us"] for x in lists], 0.9),
        "ensure_us": med("ensure_us"),
        "copies": med("copies"),
        "gaps_us": med("gaps_us"),
        "tail_us": med("tail_us"),
        "up_tail_us": med("up_tail_us"),
        "link_busy_us": statistics.median(busy) / 1e3,
        "link_idle_us": statistics.median(idle) / 1e3,
        "gbs": nbytes / sum(busy) if nbytes else None,
    }


def summarize(ops: list[GpuOp], steps: int, tokens_per_step: int = 1, copy_kernel: str = MISS_COPY) -> dict:
    """Per step (medians over the steps): kernels, busy_us (union of operation intervals), gpu_us (first start to
    last end), tok_s (tokens over the start-to-start period); per stream: ops per step, median and p90 gap between
    consecutive operations within a step (µs); `top`: the operations taking most time, by name (µs and count per
    step, with a short name, and the µs each adds to its stream's timeline: `_top_ops`); where a branch runs beside
    the routed experts (`_parallel_branch`): `shared_us` its time per step and `overlap`, the fraction of that time
    during a miss-copy kernel; where the copy service served lists, `copy_lists` (`_copy_lists`)."""
    count = {
        s: (sum(o.kernel for o in ops if o.stream == s), sum(o.stream == s for o in ops))
        for s in {o.stream for o in ops}
    }
    streams = sorted(count, key=lambda s: (-count[s][0], -count[s][1], s))
    main = streams[0] if ops else None  # the stream with the most kernels: every step launches the same there
    mine = [o for o in ops if o.stream == main]
    if steps < 2 or not mine or len(mine) % steps:
        raise ValueError(
            f"{len(mine)} operations on the busiest stream do not split into {steps} identical steps (need >= 2 steps)"
        )
    starts = [o.start for o in mine[:: len(mine) // steps]]
    chunks = _steps(ops, starts)
    busy = [sum(b - a for a, b in _union([(o.start, o.end) for o in c])) for c in chunks]
    span = [max(o.end for o in c) - c[0].start for c in chunks]
    period = [b - a for a, b in zip(starts, starts[1:])]
    out = {
        "steps": steps,
        "kernels": statistics.median(sum(o.kernel for o in c) for c in chunks),
        "ops": statistics.median(len(c) for c in chunks),
        "busy_us": statistics.median(busy) / 1e3,
        "gpu_us": statistics.median(span) / 1e3,
        "period_us": statistics.median(period) / 1e3,
        "tok_s": tokens_per_step * 1e9 / statistics.median(period),
        "streams": {},
        "top": _top_ops(ops, steps),
    }
    for s in streams:
        gaps = []
        for c in chunks:
            mine = [o for o in c if o.stream == s]
            gaps += [max(0, b.start - a.end) / 1e3 for a, b in zip(mine, mine[1:])]
        out["streams"][str(s)] = {
            "role": "main" if s == main else "other",
            "ops_per_step": statistics.median(sum(o.stream == s for o in c) for c in chunks),
            "gap_median_us": statistics.median(gaps) if gaps else 0.0,
            "gap_p90_us": _quantile(gaps, 0.9),
        }
    served = _copy_lists(chunks, main)
    if served is not None:
        out["copy_lists"] = served
    shared = [o for c in chunks for o in _parallel_branch(c, main, copy_kernel)]
    if shared:
        copies = _union([(o.start, o.end) for o in ops if _is_copy(o, main, copy_kernel)])
        total = sum(o.end - o.start for o in shared)
        out["shared_us"] = total / steps / 1e3
        out["overlap"] = sum(_covered(o.start, o.end, copies) for o in shared) / total
    return out
