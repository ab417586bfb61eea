"""The first launch of a graph that waits for the host's PLE release, run in a child process (a launch that never
returns would otherwise hang the test run): `python -m tests.gpu.ple_first_launch UPLOAD WARM MODE`.

The graph: a matmul (work before the wait), the wait on the flag (`WaitSync.capture`) and its reset, then a kernel
reading a staged row from pinned host memory. Captured by `capture_graph` with UPLOAD `auto` (as the engine does: it
uploads the graph, whose replay hook needs an upload), `capture` (uploaded regardless) or `none` (not uploaded) and,
with WARM=1, one warm replay through its hooks (released by its hook's fill thread).
MODE `bare`: the row is staged, then the graph launched without its hooks (`torch.cuda.CUDAGraph.replay`), the flag
released only after the launch returns, or after 10 s by a watchdog thread if the launch blocks. MODE `hooked`: the
engine's order (`HookedGraph.replay`: the fill handed to a thread before the launch). Prints one JSON line."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.ple_gather import gather_rows
from edgemoe.layers.ple_wait import make_wait_sync

WATCHDOG_S = 10.0  # a launch not back by then is taken as blocked (a first launch loads modules: seconds, loaded)


def main(upload: str, warm: bool, mode: str) -> dict:
    value = {"row": 0.0}
    table = torch.zeros(4, 256, pin_memory=True)  # staged rows, read by the graph after its wait
    idx = torch.tensor([2], device="cuda")
    x = torch.randn(4096, 4096, device="cuda")

    def fill() -> None:
        table[2].fill_(value["row"])

    sync = make_wait_sync(torch.device("cuda"), fill)
    assert sync is not None, "this driver cannot wait in a graph"

    def step() -> torch.Tensor:
        y = x @ x
        if torch.cuda.is_current_stream_capturing():
            sync.capture()
        return y[0, :256] * 0 + gather_rows(table, idx)[0]

    graph, out = capture_graph(step, upload={"auto": None, "capture": True, "none": False}[upload])
    if warm:
        graph.replay()
        torch.cuda.synchronize()
    value["row"] = 7.0
    released_by, start = "host", time.monotonic()
    if mode == "hooked":
        graph.replay()
        launch_s = time.monotonic() - start
    else:
        fill()
        fired = threading.Event()

        def rescue() -> None:
            fired.set()
            sync.flag.release()

        watchdog = threading.Timer(WATCHDOG_S, rescue)
        watchdog.start()
        torch.cuda.CUDAGraph.replay(graph)  # no hooks: nobody releases the flag before this returns
        launch_s = time.monotonic() - start
        watchdog.cancel()
        if fired.is_set():
            released_by = "watchdog"
        else:
            sync.flag.release()
    torch.cuda.synchronize()
    return {
        "uploaded": graph.uploaded,
        "needs_upload": graph.needs_upload,
        "launch_s": launch_s,
        "released_by": released_by,
        "row": out[0].item(),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "1", sys.argv[3])))
