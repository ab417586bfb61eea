"""benchmarks/persistent_chain.py's kernels (a chain of dependent GEMVs in one persistent launch: tasks from an
atomic queue with counters per launch parity, or statically assigned with counters that only grow) against a
float64 torch chain: its `--check` mode, which on a machine without CUDA runs small off-block shapes under Triton's
interpreter (the queue kernel at 1 and 3 programs, the static one at 1: the interpreter runs programs in turn), with
and without the weight columns loaded before the wait, two launches each (the second on the next counters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "persistent_chain.py"


def test_check_mode_passes() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for kernel in ("persistent", "static"):  # the queue kernel, and the statically assigned one (one program here)
        lines = [line for line in proc.stdout.splitlines() if f"{kernel} chain within" in line]
        assert [line.split(" layers")[0] for line in lines] == ["3", "8"], proc.stdout


def test_bad_flags_exit_with_one_line() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check", "--block-n", "3"], capture_output=True, text=True)
    assert proc.returncode != 0 and "powers of two" in proc.stderr and "Traceback" not in proc.stderr
