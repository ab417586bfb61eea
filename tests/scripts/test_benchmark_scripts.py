"""The benchmark scripts that run off CUDA, at toy sizes on the CPU, checked for what they must show besides timings:
fair prefill runs one decode step of the waiting stream after every prefill chunk; every PLE backend and sync mode
generates the same tokens; streamed prefill copies every expert of every layer once a chunk; speculative decoding
gives the output plain decoding does, with drafts made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args, "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_fair_prefill_interleaves_a_decode_step_per_chunk(tmp_path) -> None:
    r = run_script("fair_prefill.py", "--size", "tiny", "--prompt", "640", "--chunk", "64", "--before", "4",
                   out=tmp_path / "fair.json")  # fmt: skip
    assert r["chunks"] == 10
    assert r["stream_tokens_during"] == r["chunks"] - 1  # a token after each chunk but the last, which ends it
    assert r["ttft_s"] > 0 and r["during_gap_ms_p50"] > 0


def test_ple_backends_give_the_same_tokens(tmp_path) -> None:
    r = run_script("ple.py", "--geometry", "tiny", "--tokens", "6", "--folder", str(tmp_path / "model"),
                   out=tmp_path / "ple.json")  # fmt: skip
    assert len(r["runs"]) == 7 and all(run["same"] for run in r["runs"].values()), r["runs"]


def test_streamed_prefill_copies_every_expert_once_a_chunk(tmp_path) -> None:
    # 0.4 x 6 layers x 32 experts: two layers' worth, not all; what a warm-up leaves cached (the last two layers)
    # is a third, so each timed chunk expects most experts to miss and streams
    r = run_script("prefill_stream.py", "--device", "cpu", "--geometry", "small", "--layers", "6", "--fraction",
                   "0.4", "--tokens", "48,96", out=tmp_path / "stream.json")  # fmt: skip
    assert r["streams"] and 64 <= r["slots"] < 6 * 32
    assert [run["bytes_copied"] for run in r["runs"]] == [6 * 32 * r["expert_bytes"]] * 2


def test_speculative_output_identical_and_drafts_accepted(tmp_path) -> None:
    r = run_script("speculative.py", "--tokens", "24", "--draft", "3", "--repeats", "1", out=tmp_path / "spec.json")
    plain, spec = r["runs"]
    assert plain["draft"] == 0 and spec["draft"] == 3 and spec["identical"]
    assert spec["drafted"] > 0  # the passage drafts from its earlier copies (how many pass: the gate's timings)
