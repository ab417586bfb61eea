"""What `edgemoe bench` and the scripts in benchmarks/ measure with, and how a run is held against its bound: the
timing of work on a device (`timed`, CUDA events), the two rates a bound needs (`bandwidths`: HBM by a device copy,
PCIe by a pinned host copy of expert rows), a step captured as the engine captures it (`capture`), the bound of docs
(SYSTEM.md) and its settling at the higher of two readings (`set_bound`, `settle_bounds`, `settled`), and a run's
report (`run_line`, `profile_lines`, `plot`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edgemoe.engine.cuda_graphs import HookedGraph, capture_graph
from edgemoe.offload.experts import MiB


def timed(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of `fn` (after one warm call)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def bandwidths(device: torch.device, row_bytes: int, rows: int = 8, rounds: int = 5) -> dict:
    """HBM: device-to-device copy (read + write bytes); PCIe: pinned host -> device copy of `rows` expert rows. Each
    the fastest of `rounds` timed rounds: a bound is a ceiling, and on a shared host one round of host copies can
    lose a few per cent to other work (an H2D figure of 52.4 and 53.6 GB/s where the same machine gave 55.3)."""
    if device.type != "cuda":
        return {"hbm_bytes_per_s": None, "h2d_bytes_per_s": None}
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    hbm = 2 * n / min(timed(lambda: b.copy_(a), device, 10) for _ in range(rounds))
    host = torch.empty(rows * row_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    h2d = host.numel() / min(timed(lambda: dev.copy_(host, non_blocking=True), device, 20) for _ in range(rounds))
    return {"hbm_bytes_per_s": hbm, "h2d_bytes_per_s": h2d}


def settled(result: dict, device: torch.device, row_bytes: int) -> dict:
    """`result` with its bounds at the higher of the bandwidths measured before and after its runs (reprinted
    where that changed them). Without the memory for the second reading's buffers the first stands, said once."""
    if device.type != "cuda":
        return result
    try:
        again = bandwidths(device, row_bytes)
    except torch.cuda.OutOfMemoryError:
        print("no device memory left for the second bandwidth reading: the bounds use the first", file=sys.stderr)
        return result
    if settle_bounds(result, again):
        first, again = result["bandwidths_measured"]
        print(
            f"bandwidths after the runs: HBM {again['hbm_bytes_per_s'] / 1e9:.0f} GB/s (before "
            f"{first['hbm_bytes_per_s'] / 1e9:.0f}), H2D {again['h2d_bytes_per_s'] / 1e9:.1f} GB/s (before "
            f"{first['h2d_bytes_per_s'] / 1e9:.1f}); the bounds use the higher figures:",
            file=sys.stderr,
        )
        for run in result["runs"]:
            print(run_line(run), file=sys.stderr)
    return result


def capture(step: Callable[[], object]) -> HookedGraph:
    """One decode step (or any work) as a CUDA graph, as the engine captures it."""
    return capture_graph(step)[0]


def set_bound(run: dict, bw: dict) -> None:
    """The run's bound (SYSTEM.md) at these bandwidths, and its tok/s against it. With a CPU split also the bound that
    counts both links (#34): every missed byte, copied or computed on the CPU, over PCIe and the CPU's rate together
    (`cpu_bytes_per_s`: `auto`'s start-up measurement, or the same measurement made here for a manual N), plus the
    HBM time."""
    hbm = run["hbm_bytes_per_token"] / bw["hbm_bytes_per_s"]
    bound = hbm + run["miss_bytes_per_token"] / bw["h2d_bytes_per_s"]
    run.update(bound_tok_s=1 / bound, achieved_over_bound=run["tok_s"] * bound)
    if "disk_bytes_per_token" in run and bw.get("disk_bytes_per_s"):  # with the RAM tier: the disk's reads too (#51)
        three = bound + run["disk_bytes_per_token"] / bw["disk_bytes_per_s"]
        run.update(three_link_bound_tok_s=1 / three, achieved_over_three_link=run["tok_s"] * three)
    if "cpu_bytes_per_s" in run:
        missed = run["miss_bytes_per_token"] + run["cpu_bytes_per_token"]
        two = hbm + missed / (bw["h2d_bytes_per_s"] + run["cpu_bytes_per_s"])
        run.update(two_link_bound_tok_s=1 / two, achieved_over_two_link=run["tok_s"] * two)


def settle_bounds(result: dict, again: dict) -> bool:
    """Bandwidths measured again after the runs (`again`): keep each one's higher figure and recompute every
    run's bound with them. Both measurements stay in the result. -> whether a bound changed."""
    keys = ("hbm_bytes_per_s", "h2d_bytes_per_s")
    first = {k: result[k] for k in keys}
    if first["hbm_bytes_per_s"] is None or again["hbm_bytes_per_s"] is None:
        return False
    result["bandwidths_measured"] = [first, {k: again[k] for k in keys}]
    best = {k: max(first[k], again[k]) for k in keys}
    if best == first:
        return False
    result.update(best)
    for run in result["runs"]:
        if "bound_tok_s" in run:
            set_bound(run, best)
    return True


def run_line(r: dict) -> str:
    if "error" in r:
        return f"{r['policy']:>6} {r['slots']:>6} slots {r['mode']:>5}: {r['error']}"
    overlap = " +overlap" if r.get("shared_expert_overlap") else ""
    bound = (
        f", bound {r['bound_tok_s']:.1f} tok/s, achieved/bound {r['achieved_over_bound']:.2f}"
        if "bound_tok_s" in r
        else ""
    )
    if "two_link_bound_tok_s" in r:
        bound += f", two-link bound {r['two_link_bound_tok_s']:.1f} tok/s ({r['achieved_over_two_link']:.2f})"
    if "ram_tier" in r:
        t = r["ram_tier"]
        read = r["disk_bytes_per_token"] / MiB
        bound += f"; RAM tier {t['rows']} rows, hit rate {t['hit_rate']:.3f}, {read:.1f} MiB read/token"
    if "three_link_bound_tok_s" in r:
        bound += f", three-link bound {r['three_link_bound_tok_s']:.1f} tok/s ({r['achieved_over_three_link']:.2f})"
    return (
        f"{r['policy']:>6}{overlap} {r['slots']:>6} slots ({r['fraction']:.0%}) {r['mode']:>5}: "
        f"{r['tok_s']:.1f} tok/s, "
        f"hit rate {r['hit_rate']:.3f}, {r['miss_bytes_per_token'] / MiB:.1f} MiB copied/token, "
        f"{r['cpu_misses_per_token']:.1f} misses/token on the CPU{bound}"
    )


def profile_lines(profile: dict | None) -> list[str]:
    """`--profile`'s figures as text (`profiler.summarize`'s summary; None: none): the step, then the copy lists
    (offloaded graph replays: `edgemoe.tools.profiler._copy_lists`) and the costliest kernels, each with what it adds
    to its stream's timeline per step (under PDL its own duration counts its wait)."""
    if not profile:
        return []
    main = next((s for s in profile["streams"].values() if s["role"] == "main"), {"gap_median_us": 0.0})
    lines = [
        f"  profile: {profile['period_us']:.0f} us a step, {profile['kernels']:.0f} kernels, median gap "
        f"{main['gap_median_us']:.2f} us on the main stream"
    ]
    if "copy_lists" in profile:
        c = profile["copy_lists"]
        tail = "-" if c["tail_us"] is None else f"{c['tail_us']:.1f}"
        up = "-" if c["up_tail_us"] is None else f"{c['up_tail_us']:.1f}"
        rate = "" if c["gbs"] is None else f", {c['gbs']:.1f} GB/s while copying"
        lines.append(
            f"    copy lists: {c['lists']:.0f} a step; first byte {c['first_byte_us']:.1f} us after the router (p90 "
            f"{c['first_byte_p90_us']:.1f}; ensure ends at {c['ensure_us']:.1f}); {c['copies']:.1f} copies a list, "
            f"{c['gaps_us']:.1f} us idle between them; {tail} us from the last byte to down's end ({up} to up's); "
            f"link busy {c['link_busy_us']:.0f} us, idle {c['link_idle_us']:.0f} us a step{rate}"
        )
    lines.append(f"    {'kernel':<44}{'calls':>7}{'us/call':>10}{'adds us/step':>14}")
    for t in profile["top"]:
        lines.append(f"    {t['name'][:44]:<44}{t['count']:>7.0f}{t['us'] / t['count']:>10.2f}{t['extends_us']:>14.1f}")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    runs = [r for r in result["runs"] if "error" not in r]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        for mode in dict.fromkeys(r["mode"] for r in runs):
            pts = sorted((r["fraction"], r["tok_s"]) for r in runs if r["policy"] == policy and r["mode"] == mode)
            ax.plot(*zip(*pts), marker="o", label=f"{policy} {mode}")
    bounds = sorted(
        {r["fraction"]: r["bound_tok_s"] for r in runs if "bound_tok_s" in r and r["policy"] == "lru"}.items()
    )
    if bounds:
        ax.plot(*zip(*bounds), "k--", label="bound (lru)")
    ax.set(
        xlabel="experts cached (fraction)",
        ylabel="decode tok/s, batch 1",
        title=f"{result['geometry']}, {result['layers']} layers, {result['context']} context",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
