"""PLE backends on CUDA: the gather kernel reads pinned host rows inside a replayed graph; `host` and `disk` (host and
wait sync) give the `gpu` backend's logits bitwise at every replayed decode step of a tiny Gemma-4 (float32), and its
tokens under every upload policy; wait-sync graphs each hold a wait and are the only ones `auto` uploads; and, in a
child process guarded by a timeout, what the first launch of a wait-sync graph does with and without an upload."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.ple_gather import gather_rows
from tests.models.test_gemma4 import CASES, gemma_model, save
from tests.models.test_hf_parity import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


def test_gather_reads_pinned_rows_inside_a_graph() -> None:
    table = torch.randn(1000, 3 * 256 + 8).to(torch.bfloat16).pin_memory()
    ids = torch.tensor([5, 999, 5, 0], device="cuda")
    graph, out = capture_graph(lambda: gather_rows(table, ids))
    for new in ([1, 2, 3, 4], [999, 999, 7, 0]):
        ids.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), table[torch.tensor(new)])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save(gemma_model(**CASES["moe-ple-kvshared"]), tmp_path_factory.mktemp("gemma4-ple"), "fused")


def batch() -> list[list[int]]:
    a, b, c = prompts(5)
    return [a + a, b, c]  # three sequences: the graph of four, a padding row


def run(folder: Path, **engine) -> tuple[list[list[int]], list[torch.Tensor], LLM]:
    """Greedy tokens, the logits of every replayed step, the LLM."""
    llm = LLM(str(folder), device="cuda", dtype="float32", progress=False, max_num_seqs=4, **engine)
    graphs, logits = llm.engine.runner.graphs, []
    original = graphs.replay
    graphs.replay = lambda b: (lambda out: (logits.append(out.clone()), out)[1])(original(b))
    outs = [o.token_ids for o in llm.generate(batch(), GREEDY)]
    assert len(logits) >= GREEDY.max_tokens - 1, "decode steps were not replayed"
    return outs, logits, llm


@pytest.fixture(scope="module")
def oracle(folder: Path):
    outs, logits, llm = run(folder)
    assert not any(g.uploaded for g in llm.engine.runner.graphs.graphs.values()), "auto uploads no graph without a wait"
    return outs, logits


@pytest.mark.parametrize(("backend", "sync"), [("host", "host"), ("disk", "host"), ("disk", "wait")])
def test_backends_replay_the_gpu_backends_logits(folder: Path, oracle, backend: str, sync: str) -> None:
    outs, logits, llm = run(folder, ple_backend=backend, ple_sync=sync)
    assert outs == oracle[0]
    # the three sequences' rows; the graph's fourth row is padding, whose token (and so PLE row) is whatever the
    # buffers held: the runner drops its logits
    assert len(logits) == len(oracle[1]) and all(torch.equal(a[:3], b[:3]) for a, b in zip(logits, oracle[1]))
    ple, graphs = llm.engine.model.model.embed_tokens_per_layer, llm.engine.runner.graphs.graphs
    if sync == "wait":
        assert ple.wait is not None, "the probe found no stream memory operations on this GPU"
        assert ple.captured_waits == len(graphs) and ple.wait.worker.replays >= len(logits)
        assert all(g.needs_upload and g.uploaded for g in graphs.values()), "auto uploads every graph with a wait"
    else:
        assert not any(g.uploaded for g in graphs.values())


def first_launch(upload: str, warm: bool, mode: str, timeout: float = 60.0) -> dict:
    """tests/gpu/ple_first_launch.py in a child process; {"outcome": "deadlocked"} when it outlives `timeout` (its
    watchdog thread could not release the flag: the blocked launch held the interpreter)."""
    cmd = [sys.executable, "-m", "tests.gpu.ple_first_launch", upload, "1" if warm else "0", mode]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "deadlocked"}
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    blocked = result["released_by"] == "watchdog"
    return result | {"outcome": "blocked until released" if blocked else "returned before the release"}


@pytest.mark.parametrize(("upload", "warm"), [("capture", False), ("auto", False), ("none", True)])
def test_first_launch_returns_before_the_release_when_uploaded_or_warm(upload: str, warm: bool) -> None:
    result = first_launch(upload, warm, "bare")
    assert result["outcome"] == "returned before the release", result  # (no time bound: a loaded machine is slow)
    assert result["row"] == 7.0
    assert result["uploaded"] == (upload != "none") and result["needs_upload"]


def test_first_launch_without_upload() -> None:
    """What a first launch without upload or warm replay does (reported: it depends on the driver), and that the
    engine's order, the fill handed to a thread before the launch, still completes without one."""
    bare = first_launch("none", False, "bare")
    warnings.warn(f"first launch of a wait-sync graph without upload: {bare['outcome']} ({bare})", stacklevel=1)
    assert bare["outcome"] in ("returned before the release", "blocked until released", "deadlocked")
    hooked = first_launch("none", False, "hooked")
    assert hooked.get("row") == 7.0 and hooked["launch_s"] < 5.0, hooked
