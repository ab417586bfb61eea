"""Probe: the engine's miss copy by the copy engine (`edgemoe.offload.copy_service`) against a pinned memcpy.

    python benchmarks/copy_service.py [--layers 48] [--rows 1,2,3,8] [--json OUT]

Each MoE layer of a decode graph posts its copy list to the service's mailbox and waits for its entries' arrival
counters (in the engine the expert GEMV waits on them entry by entry); replaying the graph, the host serves the
lists (`CopyService.serve`). Here one CUDA graph holds `--layers` such layers, each listing `--rows` qwen3-30b-a3b
experts (6 + 3 MiB rows), all to distinct slots, so the copied rows are checked bitwise after each variant.

Variants, timed in the same run:
- `memcpy`: one pinned host -> device copy of all the bytes, in one block (the reference);
- `host_rows`: one captured `cudaMemcpyAsync` per row, from a list the host knows (a ceiling for any copy that
  issues a copy per row);
- `host_joined`: the same with each expert's two rows side by side in one bank row and one slot (one copy an
  expert instead of two), and `host_quarters`: each of the two rows in 4 copies (8 an expert). Against
  `host_rows`, these give what one more copy costs the copy engine;
- `service_joined2`: `service_batch2` (below) over that layout, the engine's (`edgemoe.offload.layout.split_rows`);
- `host_two_streams`: `host_rows` with each expert's gate_up row on one stream and its down row on another (two
  copy engines, if the GPU runs them side by side);
- `sm`: the engine's eager copy, SMs reading pinned memory (`edgemoe.kernels.miss_copy.copy_rows_pair`);
- `service_rows`: the service issuing one `cuMemcpyHtoDAsync` per row (drivers without `cuMemcpyBatchAsync`);
- `service_batch<g>`: the service issuing one `cuMemcpyBatchAsync` per `g` entries, each group's counters written
  after its batch (`g` = 1, 2 and all of a layer's rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from edgemoe.kernels.miss_copy import chunks_per_entry, copy_rows_pair, post_list
from edgemoe.offload.banks import allocate_bank
from edgemoe.offload.copy_service import CopyService, Driver
from edgemoe.offload.layout import split_rows
from edgemoe.tools.measure import timed

HIDDEN, INTER = 2048, 768  # qwen3-30b-a3b


def check_rows(k, src: torch.Tensor, dst: torch.Tensor, n: int) -> bool:
    """Every listed row of every layer, bitwise in its slot (the slots of one replay are distinct)."""
    for layer in range(k.layers):
        for i in range(n):
            s, d = int(src[layer, i]), int(dst[layer, i])
            for pool, bank in zip(k.pools, k.banks, strict=True):
                if not torch.equal(pool[d].view(torch.int16).cpu(), bank[s].view(torch.int16)):
                    return False
    return True


def check_joined(k, src: torch.Tensor, dst: torch.Tensor, n: int) -> bool:
    """The side-by-side variants' rows, bitwise in their slots."""
    pool, bank = k.joined_pool.view(torch.int16), k.joined_bank.view(torch.int16)
    return all(
        torch.equal(pool[int(dst[layer, i])].cpu(), bank[int(src[layer, i])])
        for layer in range(k.layers)
        for i in range(n)
    )


def capture(k, body) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(k.layers):
            body(layer)
    return graph


@triton.jit
def _post(src, dst, count, tick, mailbox, bank_a, bank_b, M, RING: tl.constexpr, MAX: tl.constexpr,
          WIDTH: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    n = tl.load(count)
    if n > 0:  # the engine never posts an empty list either
        post_list(src, dst, n, tick, mailbox, bank_a, bank_b, M, tl.arange(0, BLOCK_M), RING, MAX, WIDTH)


def post(service: CopyService, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor, banks) -> None:
    """What the engine's captured `ensure` does once its victims are chosen (`post_list` into the service's mailbox),
    as a kernel of its own: the list here comes from the host, not from an `ensure`."""
    t = service.target(banks)
    M = src.numel()
    _post[(1,)](src, dst, count, t.tick, t.mailbox, t.bank_a, t.bank_b, M, t.ring, t.max_entries, t.width,
                triton.next_power_of_2(M), num_warps=1)  # fmt: skip


def service_variant(k, lists, group: int, reps: int, joined: bool = False) -> tuple[float, dict]:
    """Seconds per served replay of a graph whose layers post `lists` to a service, and what it copied. `joined`:
    the service over the side-by-side banks and pool (`split_rows`, the engine's layout)."""
    d_src, d_dst, d_count = lists
    driver = Driver(k.dev)
    if group and driver.functions[3] is None:
        return float("nan"), {"skipped": "the driver has no cuMemcpyBatchAsync"}
    pools, banks = k.joined_views if joined else (k.pools, k.banks)
    service = CopyService(pools, k.counters, k.chunks, k.max_entries, group=group, driver=driver)

    def layer_step(layer: int) -> None:
        k.counters.zero_()  # as ensure does
        post(service, d_src[layer], d_dst[layer], d_count[layer], banks)
        service.wait(d_count[layer])

    graph = capture(k, layer_step)

    def step() -> None:
        graph.replay()
        service.serve()

    seconds = timed(step, k.dev, reps)
    return seconds, {"served": service.served, "one_copy_an_entry": service.joined}


def memcpy_seconds(k, nbytes: int, reps: int) -> float:
    """One pinned host -> device copy of `nbytes` in one block."""
    block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty_like(block, device=k.dev)
    return timed(lambda: on_device.copy_(block, non_blocking=True), k.dev, reps)


def run_rows(k, n: int, gen: torch.Generator, reps: int) -> dict:
    """Every variant for `n` rows a layer (see the module docstring)."""
    L, M, S = k.layers, k.max_entries, k.slots
    src = torch.zeros((L, M), dtype=torch.int64)
    dst = torch.full((L, M), S, dtype=torch.int64)
    slots = torch.randperm(S, generator=gen)[: L * n].view(L, n)
    for layer in range(L):
        src[layer, :n] = torch.randperm(k.experts, generator=gen)[:n]
        dst[layer, :n] = slots[layer]
    lists = src.to(k.dev), dst.to(k.dev), torch.full((L,), n, dtype=torch.int64, device=k.dev)
    out = {"memcpy_s": memcpy_seconds(k, L * n * sum(b[0].nbytes for b in k.banks), reps)}

    def host_rows(layer: int) -> None:
        for i in range(n):
            s, d = int(src[layer, i]), int(dst[layer, i])
            for pool, bank in zip(k.pools, k.banks, strict=True):
                pool[d].copy_(bank[s], non_blocking=True)

    def sm_rows(layer: int) -> None:
        copy_rows_pair(k.pools, k.banks, lists[0][layer], lists[1][layer], lists[2][layer])

    def host_quarters(layer: int) -> None:
        for i in range(n):
            s, d = int(src[layer, i]), int(dst[layer, i])
            for pool, bank in zip(k.pools, k.banks, strict=True):
                for part_dst, part_src in zip(pool[d].chunk(4), bank[s].chunk(4), strict=True):
                    part_dst.copy_(part_src, non_blocking=True)

    def host_joined(layer: int) -> None:
        for i in range(n):
            k.joined_pool[int(dst[layer, i])].copy_(k.joined_bank[int(src[layer, i])], non_blocking=True)

    def host_two_streams(layer: int) -> None:
        here = torch.cuda.current_stream()
        for side in k.side_streams:
            side.wait_stream(here)
        for i in range(n):
            s, d = int(src[layer, i]), int(dst[layer, i])
            for j, (pool, bank) in enumerate(zip(k.pools, k.banks, strict=True)):
                with torch.cuda.stream(k.side_streams[j]):  # gate_up rows on one, down rows on the other
                    pool[d].copy_(bank[s], non_blocking=True)
        for side in k.side_streams:
            here.wait_stream(side)

    for name, how in {"host_joined": capture(k, host_joined).replay, "service_joined2": 2}.items():
        k.joined_pool.zero_()
        if callable(how):
            out[f"{name}_s"], check = timed(how, k.dev, reps), {}
        else:
            out[f"{name}_s"], check = service_variant(k, lists, how, reps, joined=True)
        torch.cuda.synchronize()
        out[f"{name}_check"] = check | {"rows_equal": check_joined(k, src, dst, n)}
    variants = {
        "host_rows": host_rows,
        "host_quarters": host_quarters,
        "host_two_streams": host_two_streams,
        "sm": sm_rows,
        "service_rows": 0,
    }
    variants |= {f"service_batch{g}": g for g in sorted({1, 2, n})}
    for name, how in variants.items():
        for pool in k.pools:
            pool.zero_()
        if callable(how):
            out[f"{name}_s"], check = timed(capture(k, how).replay, k.dev, reps), {}
        else:
            out[f"{name}_s"], check = service_variant(k, lists, how, reps)
        torch.cuda.synchronize()
        out[f"{name}_check"] = check | {"rows_equal": check_rows(k, src, dst, n)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--rows", default="1,2,3,8")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_service.py needs a CUDA GPU")
    rows = [int(x) for x in args.rows.split(",")]
    k = SimpleNamespace(dev=torch.device("cuda"), layers=args.layers, experts=args.experts, max_entries=max(rows))
    gen = torch.Generator().manual_seed(0)
    k.slots = k.layers * max(rows)  # every row of a replay its own slot
    k.banks = (
        allocate_bank((k.experts, 2 * INTER, HIDDEN), torch.bfloat16, pin=True),
        allocate_bank((k.experts, HIDDEN, INTER), torch.bfloat16, pin=True),
    )
    for bank in k.banks:
        bank.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, bank.shape, dtype=torch.int16, generator=gen))
    k.pools = tuple(torch.empty((k.slots + 1, *b.shape[1:]), dtype=b.dtype, device=k.dev) for b in k.banks)
    k.chunks = chunks_per_entry(k.pools)
    k.side_streams = (torch.cuda.Stream(), torch.cuda.Stream())
    k.joined_bank = allocate_bank((k.experts, 3 * INTER * HIDDEN), torch.bfloat16, pin=True)
    k.joined_bank.copy_(torch.cat([b.view(k.experts, -1) for b in k.banks], dim=1))
    k.joined_pool = torch.empty((k.slots + 1, 3 * INTER * HIDDEN), dtype=torch.bfloat16, device=k.dev)
    k.joined_views = split_rows(k.joined_pool, INTER, HIDDEN), split_rows(k.joined_bank, INTER, HIDDEN)
    k.counters = torch.zeros(k.max_entries, dtype=torch.int64, device=k.dev)
    row_bytes = sum(b[0].nbytes for b in k.banks)
    results = {"layers": k.layers, "row_bytes": row_bytes, "rows": {}}
    for n in rows:
        out = results["rows"][n] = run_rows(k, n, gen, args.reps)
        line = [f"rows/layer {n}:"]
        for name, v in out.items():
            if name.endswith("_s"):
                gbs = k.layers * n * row_bytes / v / 1e9
                line.append(f"{name[:-2]} {v * 1e3:.3f} ms ({gbs:.1f} GB/s, {out['memcpy_s'] / v:.3f} of memcpy)")
        print("\n  ".join(line))
        print("  checks:", {name[:-6]: v for name, v in out.items() if name.endswith("_check")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
