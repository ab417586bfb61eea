"""`edgemoe bench` on the CPU, tiny geometry: it runs, drives the cache from a trace, writes its JSON (GPU figures
come from the GPU machine; see benchmarks/RESULTS.md)."""

from __future__ import annotations

import json

import numpy as np

from edgemoe.cli import main


def test_bench_runs_on_a_tiny_geometry(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--geometry",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--moe-cache-fraction",
        "0.25,1",
        "--routing-trace",
        "synthetic",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--prefill",
        "32",
        "--context",
        "40",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [(r["slots"], r["policy"]) for r in result["runs"]] == [
        (6, "lru"),
        (6, "scored"),
        (24, "lru"),
        (24, "scored"),
    ]
    for r in result["runs"]:
        assert r["tok_s"] > 0 and 0 <= r["hit_rate"] <= 1
        assert r["miss_bytes_per_token"] == r["misses_per_token"] * result["expert_bytes"]
    assert result["runs"][0]["misses_per_token"] > result["runs"][2]["misses_per_token"]
    assert result["prefill"]["bytes_missed"] > 0

    trace = tmp_path / "t.npy"
    quick = argv[:7] + ["--moe-cache-fraction", "1", "--moe-policy", "lru", "--prefill", "0", "--routing-trace"]
    np.save(trace, np.zeros((5, 3, 2), dtype=np.int32))
    assert main(quick + [str(trace)]) == 0
    capsys.readouterr()
    np.save(trace, np.zeros((5, 2, 2), dtype=np.int32))
    assert main(quick + [str(trace)]) == 2
    assert "the model needs [steps, >= 3, 2]" in capsys.readouterr().err
    assert main(argv[:7]) == 2
    assert "give one of --moe-cache-fraction or --vram-budget" in capsys.readouterr().err
