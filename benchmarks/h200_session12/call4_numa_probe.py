"""Where the pinned expert banks land (NUMA nodes) and how fast each part copies to the GPU: 96 banks of 512 MiB
allocated and pinned as `edgemoe.moe.banks.allocate_bank` does, the process's pages per node from numa_maps, then
three 512 MiB copies from each bank to the GPU (the first line, a torch-pinned buffer, includes CUDA's warm-up).

    PYTHONPATH=. python benchmarks/h200_session12/call4_numa_probe.py
"""

import os
import re
import subprocess
import time

import torch
from edgemoe.moe.banks import allocate_bank


def sh(c):
    try:
        return subprocess.run(c, shell=True, capture_output=True, text=True, timeout=20).stdout
    except Exception as e:
        return str(e)


print(sh("lscpu | grep -i -E 'numa|socket|model name'"))
print(sh("nvidia-smi topo -m"))
print(sh("cat /sys/bus/pci/devices/*/numa_node 2>/dev/null | sort | uniq -c"))
print("affinity", sorted(os.sched_getaffinity(0)))
GB = 1 << 30
t = time.time()
banks = [allocate_bank((GB // 2,), torch.uint8, True) for _ in range(96)]  # 48 GiB in 512 MiB banks
print(f"allocated+pinned 48 GiB in {time.time() - t:.1f} s")
nodes = {}
for line in open("/proc/self/numa_maps").read().splitlines():
    for n, c in re.findall(r" N(\d+)=(\d+)", line):
        nodes[n] = nodes.get(n, 0) + int(c)
print("pages per node (all mappings):", nodes)
dst = torch.empty(GB // 2, dtype=torch.uint8, device="cuda")
small = torch.empty(GB // 2, dtype=torch.uint8, pin_memory=True)


def rate(src):
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * src.numel() / (time.perf_counter() - s) / 1e9


print(f"torch pinned 512 MiB: {rate(small):.1f} GB/s")
rates = [rate(b) for b in banks]
print("bank rates GB/s:", " ".join(f"{r:.1f}" for r in rates))
print(f"min {min(rates):.1f} max {max(rates):.1f} mean {sum(rates) / len(rates):.1f}")
