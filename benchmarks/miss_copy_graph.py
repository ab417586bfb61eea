"""The miss copy by the copy engine inside a CUDA graph, with the rows chosen on the device: does it reach issue #4's
0.95 of a pinned memcpy, which no SM-issued read of pinned host memory reached (0.86-0.90: benchmarks/miss_copy.py
and miss_copy_cuda.py, benchmarks/RESULTS.md)?

    python benchmarks/miss_copy_graph.py [--geometry qwen3-30b-a3b] [--rows 2,8] [--json OUT]

A copy engine takes its addresses from the host, so a graph's memcpy node always copies the same bytes. Switch
conditional nodes (CUDA 12.8+) choose one of several bodies on the device: here one switch per copy-list position
j, with one body per expert e holding a memcpy node bank[e] -> staging[j], and a small CUDA C kernel (NVRTC) that
sets switch j to the list's j-th expert id, or to E (no body: nothing copied) past the list's length. The victim
slot is chosen on the device too, so staging[j] then goes to its slot by an HBM-speed scatter (`index_copy_`).
Everything is added inside torch's CUDA-graph capture the way the engine would have to: the capturing graph from
`cudaStreamGetCaptureInfo`, the switch nodes added to it, the stream's dependencies moved past them with
`cudaStreamUpdateCaptureDependencies`; the graph is then replayed.

Reported as GB/s and as a fraction of a pinned memcpy of the same bytes (one contiguous block) in the same run: the
switch copies alone, switch copies + scatter, per-row `cudaMemcpyAsync` from a host list (eager), the engine's
Triton `copy_rows`, and an empty list's replay time. Copied rows are checked against the bank. Needs the GPU
machine's cuda-bindings and NVRTC; not an edgemoe dependency. Result (benchmarks/RESULTS.md): 0.84-0.91 of memcpy,
no better than the Triton copy, because each switch node costs ~7-10 us even when it copies nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch
from edgemoe.bench import timed
from edgemoe.models.random_checkpoint import PRESETS
from edgemoe.moe.banks import allocate_bank

from edgemoe.kernels.miss_copy import copy_rows

MAX_ROWS = 16  # the setter takes the switches' handles as that many kernel arguments
SETTER = r"""
typedef unsigned long long Handle;
extern "C" __device__ void cudaGraphSetConditional(Handle handle, unsigned int value);  // a device-runtime builtin

extern "C" __global__ void set_switches(const long long* ids, const long long* count, unsigned int skip, int k,
    Handle h0, Handle h1, Handle h2, Handle h3, Handle h4, Handle h5, Handle h6, Handle h7,
    Handle h8, Handle h9, Handle h10, Handle h11, Handle h12, Handle h13, Handle h14, Handle h15) {
    const Handle h[16] = {h0, h1, h2, h3, h4, h5, h6, h7, h8, h9, h10, h11, h12, h13, h14, h15};
    const int j = threadIdx.x;
    if (j < k) cudaGraphSetConditional(h[j], j < count[0] ? (unsigned int)ids[j] : skip);
}
"""


def check(result: tuple, what: str) -> tuple:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return tuple(rest)


def load_setter():
    """NVRTC -> PTX -> a driver module (the driver's JIT resolves the device-runtime builtin) -> CUfunction."""
    from cuda.bindings import driver, nvrtc

    major, minor = torch.cuda.get_device_capability()
    (prog,) = check(nvrtc.nvrtcCreateProgram(SETTER.encode(), b"set_switches.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=compute_{major}{minor}".encode(), b"--std=c++17"]
    try:
        check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram")
    except RuntimeError:
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        raise RuntimeError(f"NVRTC: {log.decode(errors='replace')}") from None
    (size,) = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
    ptx = b" " * size
    check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    torch.zeros(1, device="cuda")  # torch's primary context, current on this thread: the module's context
    (module,) = check(driver.cuModuleLoadData(ptx), "cuModuleLoadData")
    (fn,) = check(driver.cuModuleGetFunction(module, b"set_switches"), "cuModuleGetFunction")
    return module, fn


def add_switch_copies(setter, bank: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor, count: torch.Tensor):
    """Inside a capture on the current stream: the setter kernel, then one switch per staging row whose body e
    copies bank[e] into it. Returns the handles (kept alive with the graph)."""
    from cuda.bindings import driver, runtime

    stream = torch.cuda.current_stream().cuda_stream
    experts, rows, row_bytes = bank.shape[0], staging.shape[0], staging[0].numel() * staging.element_size()
    _, _, graph, _, _, _ = check(runtime.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    assign = runtime.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault  # each launch starts at "skip"
    create = runtime.cudaGraphConditionalHandleCreate
    handles = [check(create(graph, experts, assign), "cudaGraphConditionalHandleCreate")[0] for _ in range(rows)]
    values = [int(h) for h in handles] + [0] * (MAX_ROWS - rows)
    args = (ids.data_ptr(), count.data_ptr(), experts, rows, *values)
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, *[ctypes.c_ulonglong] * MAX_ROWS)
    check(driver.cuLaunchKernel(setter, 1, 1, 1, 32, 1, 1, 0, stream, (args, types), 0), "cuLaunchKernel")
    _, _, graph, deps, _, n = check(runtime.cudaStreamGetCaptureInfo(stream), "cudaStreamGetCaptureInfo")
    deps = list(deps)[:n]  # the setter's node
    nodes = []
    h2d = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
    for j, handle in enumerate(handles):
        params = runtime.cudaGraphNodeParams()
        params.type = runtime.cudaGraphNodeType.cudaGraphNodeTypeConditional
        params.conditional.handle = handle
        params.conditional.type = runtime.cudaGraphConditionalNodeType.cudaGraphCondTypeSwitch
        params.conditional.size = experts
        (node,) = check(runtime.cudaGraphAddNode(graph, deps, None, len(deps), params), "cudaGraphAddNode")
        for e, body in enumerate(params.conditional.phGraph_out):
            src, dst = bank[e].data_ptr(), staging[j].data_ptr()
            check(runtime.cudaGraphAddMemcpyNode1D(body, None, 0, dst, src, row_bytes, h2d), "memcpy node")
        nodes.append(node)
    flag = runtime.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
    check(runtime.cudaStreamUpdateCaptureDependencies(stream, nodes, None, len(nodes), flag), "update dependencies")
    return handles


def measure(setter, experts: int, row_shape: tuple[int, int], rows: int, slots: int = 64) -> dict:
    dev = torch.device("cuda")
    bank = allocate_bank((experts, *row_shape), torch.bfloat16, pin=True)
    for e in range(experts):
        bank[e].view(torch.int16).random_()
    row_bytes = bank[0].numel() * bank.element_size()
    nbytes = rows * row_bytes
    staging = torch.empty(rows, *row_shape, dtype=torch.bfloat16, device=dev)
    pool = torch.zeros(slots + 1, *row_shape, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(rows, dtype=torch.long, device=dev)  # the graphs' static copy list
    dst = torch.zeros(rows, dtype=torch.long, device=dev)
    count = torch.zeros((), dtype=torch.long, device=dev)
    out = {"row_bytes": row_bytes, "rows": rows}

    block = bank[:rows].flatten()  # pinned, contiguous: the reference memcpy
    target = torch.empty_like(block, device=dev)
    out["memcpy"] = nbytes / timed(lambda: target.copy_(block, non_blocking=True), dev, 20)

    graphs = {}
    for name, scatter in (("switch", False), ("switch_scatter", True)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            handles = add_switch_copies(setter, bank, staging, ids, count)
            if scatter:
                pool.index_copy_(0, dst, staging)
        graphs[name] = (graph, handles)

    def new_list(n: int) -> tuple[list[int], list[int]]:
        src_ids, slot_ids = torch.randperm(experts)[:rows].tolist(), torch.randperm(slots)[:rows].tolist()
        ids.copy_(torch.tensor(src_ids))
        dst.copy_(torch.tensor(slot_ids))
        count.fill_(n)
        return src_ids[:n], slot_ids

    for _ in range(3):  # correctness: new lists, full and partial
        for n in (rows, rows // 2):
            src_ids, slot_ids = new_list(n)
            pool.zero_()
            graphs["switch_scatter"][0].replay()
            torch.cuda.synchronize()
            want = bank[src_ids].to(dev).view(torch.int16)  # bitwise: random bf16 bits hold NaNs
            staged, placed = staging[:n].view(torch.int16), pool[slot_ids[:n]].view(torch.int16)
            if not torch.equal(staged, want) or not torch.equal(placed, want):
                raise AssertionError(f"switch copies wrote the wrong bytes (list of {n})")
    new_list(rows)
    for name, (graph, _) in graphs.items():
        out[name] = nbytes / timed(graph.replay, dev, 20)
    src_ids, _ = new_list(rows)
    out["per_row_memcpy"] = nbytes / timed(
        lambda: [staging[j].copy_(bank[e], non_blocking=True) for j, e in enumerate(src_ids)], dev, 20
    )
    out["triton"] = nbytes / timed(lambda: copy_rows(pool, bank, ids, dst, count), dev, 20)
    count.fill_(0)
    out["empty_list_us"] = timed(graphs["switch"][0].replay, dev, 20) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
    ap.add_argument("--rows", default="2,8", help="copy-list lengths (default: 2,8; at most 16)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/miss_copy_graph.py needs a CUDA GPU")
    lengths = [int(r) for r in a.rows.split(",")]
    if not all(1 <= r <= MAX_ROWS for r in lengths):
        raise SystemExit(f"--rows: lengths from 1 to {MAX_ROWS}")
    torch.cuda.init()
    _module, setter = load_setter()
    g = PRESETS[a.geometry]
    shape = (3 * g["moe_intermediate_size"], g["hidden_size"])  # one expert's three matrices as one row
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "geometry": a.geometry}
    for rows in lengths:
        r = results[f"rows{rows}"] = measure(setter, g["num_experts"], shape, rows)
        ratios = {k: r[k] / r["memcpy"] for k in ("switch", "switch_scatter", "per_row_memcpy", "triton")}
        print(
            f"{a.geometry} x {rows} rows of {r['row_bytes'] / 2**20:.1f} MiB: memcpy {r['memcpy'] / 1e9:.1f} GB/s; "
            + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            + f"; empty list {r['empty_list_us']:.1f} us"
        )
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
