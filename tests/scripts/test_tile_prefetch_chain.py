"""benchmarks/tile_prefetch_chain.py and handoff_latency.py without a GPU: their flags fail with one line, a machine
without CUDA gets one line, and their CUDA C++ kernels build for sm_90 (the chain's at both chunk sizes) where nvcc
is installed. The GPU machine runs them, each checking its outputs before it times them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tile_prefetch_chain.py"
HANDOFF = SCRIPT.with_name("handoff_latency.py")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chunks-kb", "4"], "--chunks-kb from 16 and 8"),
        (["--chunks-kb", "x"], "expected sizes in KB"),
        (["--loaders", "dma"], "--loaders from tma, lanes"),
        (["--modes", "fast"], "--modes from ahead, gated, streaming"),
        (["--handoffs", "mail"], "--handoffs from flags, counter"),
        (["--inflight", "64"], "--inflight: each within 0..32"),
    ],
)
def test_bad_flags_exit_with_one_line(flags: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_handoff_bad_blocks_exit_with_one_line() -> None:
    proc = subprocess.run([sys.executable, str(HANDOFF), "--blocks", "12"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "a multiple of 8" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", [SCRIPT, HANDOFF], ids=["chain", "handoff"])
def test_no_gpu_is_one_line(script: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("chunk", [16384, 8192])
def test_kernel_builds_for_sm90(chunk: int) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import tile_prefetch_chain

    cubin = tile_prefetch_chain.build(chunk)
    assert cubin.stat().st_size > 0
    shutil.rmtree(cubin.parent)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_handoff_kernels_build_for_sm90() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import tile_prefetch_chain

    cubin = tile_prefetch_chain.nvcc_build(HANDOFF.with_suffix(".cu"))
    assert cubin.stat().st_size > 0
    shutil.rmtree(cubin.parent)
