"""`edgemoe bench` on the CPU, tiny geometry: it runs, drives the cache from a trace, writes its JSON (GPU figures
come from the GPU machine; see benchmarks/RESULTS.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgemoe.cli import main
from edgemoe.engine.speculative import best_draft_count


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
    assert result["prefill"]["runs"][0]["bytes_missed"] > 0 and result["prefill"]["warmup_seconds"] > 0

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


def test_resident_bench_counts_every_expert_as_read_and_none_as_missed(tmp_path, capsys) -> None:
    out = tmp_path / "resident.json"
    argv = ["bench", "--geometry", "tiny", "--device", "cpu", "--dtype", "float32", "--moe-strategy", "resident"]
    quick = ["--steps", "3", "--warmup", "1", "--prefill", "16", "--context", "20", "--json", str(out)]
    assert main(argv + quick) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["policy"] == "resident" and run["slots"] == result["experts"] and run["fraction"] == 1
    assert run["hit_rate"] == 1 and run["misses_per_token"] == 0 and run["miss_bytes_per_token"] == 0
    (prefill,) = result["prefill"]["runs"]
    assert prefill["tokens"] == 16 and prefill["tok_s"] > 0 and prefill["first_seconds"] > 0
    assert prefill["first_over_warm"] == prefill["first_seconds"] / prefill["seconds"]
    # HBM bytes per token as offloaded decode counts them with every expert cached (its cache counts the distinct
    # experts each layer-step reads): the same dense weights, KV and top_k experts per MoE layer
    offloaded = tmp_path / "offloaded.json"
    assert main([*argv[:-2], "--moe-cache-fraction", "1", "--moe-policy", "lru", *quick[:-1], str(offloaded)]) == 0
    (cached,) = json.loads(offloaded.read_text())["runs"]
    assert cached["hbm_bytes_per_token"] == run["hbm_bytes_per_token"]
    capsys.readouterr()
    assert main(argv + ["--moe-cache-fraction", "0.5"]) == 2
    assert "--moe-strategy resident keeps every expert on the device" in capsys.readouterr().err


def test_resident_and_offloaded_bench_models_decode_the_same_tokens() -> None:
    """The resident model's experts hold the offloaded banks' values: the same greedy tokens, step by step, under a
    routing trace (the offloaded one through a cache of every expert, which Experts-level tests hold to
    transformers)."""
    import torch

    from edgemoe.offload.experts import attach_expert_cache
    from edgemoe.tools.bench import Decoder, build_model, make_runner, routing

    dev, dtype, context = torch.device("cpu"), torch.float32, 24
    tokens = {}
    for resident in (False, True):
        model = build_model("tiny", None, dev, dtype, 64, resident)
        cfg = model.config
        runner = make_runner(model, 64)
        if not resident:
            attach_expert_cache(model, sum(cfg.moe_layers) * cfg.num_experts, "lru", False, dev, dtype)
        trace = routing("synthetic", 8, sum(cfg.moe_layers), cfg.num_experts, cfg.top_k)
        dec = Decoder(runner, context, trace)
        steps = []
        with torch.inference_mode():
            for _ in range(6):
                dec.step()
                steps.append(int(runner.decode.ids[0]))
        tokens[resident] = steps
    assert tokens[True] == tokens[False] and len(set(tokens[True])) > 1


def test_trace_drives_every_layer_with_its_step_row() -> None:
    """Under a routing trace each MoE layer computes, at decode step s, with row s of the trace for that layer (the
    row is looked up once a step, then read by every layer through the routing seam), wrapping around at the
    trace's end: the ids the layers report through the same seam (`routed_ids`) are the trace's."""
    import torch

    from edgemoe.tools.bench import Decoder, build_model, make_runner, routing

    dev, dtype = torch.device("cpu"), torch.float32
    model = build_model("tiny", None, dev, dtype, 64, True)
    cfg = model.config
    runner = make_runner(model, 64)
    routed = runner.record_routing()
    trace = routing("synthetic", 3, sum(cfg.moe_layers), cfg.num_experts, cfg.top_k)
    dec = Decoder(runner, 24, trace)
    unforced = []
    with torch.inference_mode():
        for step in range(5):
            dec.step()
            assert routed[:, 0].tolist() == trace[step % 3].tolist()
        runner.forward_static(1)  # without a trace the router decides
        unforced = routed[:, 0].tolist()
    assert unforced != trace[5 % 3].tolist()


def test_bounds_use_the_higher_bandwidth_of_the_two_measurements() -> None:
    """`settle_bounds` against the bound computed by hand (SYSTEM.md: HBM bytes / HBM + missed bytes / PCIe)."""
    from edgemoe.tools.measure import set_bound, settle_bounds

    first = {"hbm_bytes_per_s": 4.0e12, "h2d_bytes_per_s": 50.0e9}
    runs = [{"tok_s": 40.0, "hbm_bytes_per_token": 6.0e9, "miss_bytes_per_token": 1.0e9}, {"error": "no capture"}]
    set_bound(runs[0], first)
    assert runs[0]["bound_tok_s"] == 1 / (6.0e9 / 4.0e12 + 1.0e9 / 50.0e9)
    result = {**first, "runs": runs}
    assert not settle_bounds(result, {"hbm_bytes_per_s": 3.9e12, "h2d_bytes_per_s": 49.0e9})  # both lower: kept
    assert result["bandwidths_measured"][1]["h2d_bytes_per_s"] == 49.0e9
    assert runs[0]["bound_tok_s"] == 1 / (6.0e9 / 4.0e12 + 1.0e9 / 50.0e9)
    assert settle_bounds(result, {"hbm_bytes_per_s": 3.9e12, "h2d_bytes_per_s": 55.0e9})  # PCIe higher after
    bound = 6.0e9 / 4.0e12 + 1.0e9 / 55.0e9  # each bandwidth's higher figure
    assert (result["hbm_bytes_per_s"], result["h2d_bytes_per_s"]) == (4.0e12, 55.0e9)
    assert runs[0]["bound_tok_s"] == 1 / bound and runs[0]["achieved_over_bound"] == 40.0 * bound
    assert "bound_tok_s" not in runs[1]
    assert not settle_bounds({"hbm_bytes_per_s": None, "h2d_bytes_per_s": None, "runs": []}, first)  # CPU


def test_prefill_lengths_are_checked(capsys) -> None:
    argv = ["bench", "--geometry", "tiny", "--device", "cpu", "--moe-strategy", "resident", "--prefill", "16,x"]
    assert main(argv) == 2
    assert "--prefill '16,x': use comma-separated token counts" in capsys.readouterr().err


def test_bench_cpu_split(tmp_path) -> None:
    """--moe-cpu-compute off,2: a copy-only run and a run with up to 2 misses a layer-step on the CPU, which copies
    less; --moe-cpu-threads 1,2 runs each split at each pool size (copy-only once)."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--geometry", "tiny", "--device", "cpu", "--dtype", "float32", "--moe-cache-fraction", "0.25",
            "--moe-policy", "lru", "--moe-cpu-compute", "off,2", "--routing-trace", "synthetic", "--steps", "4",
            "--warmup", "2", "--prefill", "0", "--context", "40", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["lru", "lru+cpu:2"]
    assert runs[0]["cpu_misses_per_token"] == 0 < runs[1]["cpu_misses_per_token"]
    assert runs[1]["miss_bytes_per_token"] < runs[0]["miss_bytes_per_token"]
    assert main(argv[:-2] + ["--moe-cpu-compute", "most"]) == 2
    assert main(argv + ["--moe-cpu-threads", "1,2"]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["runs"]] == ["lru", "lru+cpu:2/1t", "lru+cpu:2/2t"]
    assert main(argv + ["--moe-cpu-threads", "0"]) == 2


def test_vram_budgets_sweep_one_model_a_run_each(tmp_path, capsys) -> None:
    out = tmp_path / "budgets.json"
    argv = ["bench", "--geometry", "tiny", "--device", "cpu", "--dtype", "float32", "--moe-policy", "lru"]
    quick = ["--steps", "2", "--warmup", "0", "--prefill", "0", "--json", str(out)]
    assert main(argv + ["--vram-budget", "7000KiB,7500KiB", *quick]) == 0
    # the tiny model's dense weights and KV leave room for 22 of its 24 experts under the smaller budget
    assert [r["slots"] for r in json.loads(out.read_text())["runs"]] == [22, 24]
    assert main(argv + ["--vram-budget", "7000KiB,lots", *quick]) == 2
    assert "cannot read size 'lots'" in capsys.readouterr().err


def test_the_two_link_bound_counts_every_missed_byte_over_both_links() -> None:
    from edgemoe.tools.measure import set_bound

    # 1 GB of HBM reads at 1,000 GB/s (1 ms); 55 MB copied and 45 MB computed on the CPU, PCIe 55 GB/s and the CPU
    # 45 GB/s together: 1 ms more. Copy-only's bound counts the copied bytes alone (1 ms + 1 ms)
    run = {"tok_s": 250.0, "hbm_bytes_per_token": 1e9, "miss_bytes_per_token": 55e6, "cpu_bytes_per_token": 45e6,
           "cpu_bytes_per_s": 45e9}  # fmt: skip
    set_bound(run, {"hbm_bytes_per_s": 1e12, "h2d_bytes_per_s": 55e9})
    assert run["bound_tok_s"] == pytest.approx(500.0) and run["two_link_bound_tok_s"] == pytest.approx(500.0)
    assert run["achieved_over_two_link"] == pytest.approx(0.5)
    plain = {"tok_s": 250.0, "hbm_bytes_per_token": 1e9, "miss_bytes_per_token": 55e6}
    set_bound(plain, {"hbm_bytes_per_s": 1e12, "h2d_bytes_per_s": 55e9})
    assert "two_link_bound_tok_s" not in plain and plain["achieved_over_bound"] == pytest.approx(0.5)


def test_drafts_time_verify_steps_and_rate_them(tmp_path, capsys) -> None:
    """`--drafts 3`: after each run, verify steps of 4 rows (the union of 4 consecutive trace rows' experts copied
    once a step), and the decode rate at each acceptance: (1 + a + a^2 + a^3) tokens a verify step."""
    out = tmp_path / "spec.json"
    argv = ["bench", "--geometry", "tiny", "--device", "cpu", "--dtype", "float32", "--moe-policy", "lru",
            "--moe-cache-fraction", "0.5", "--routing-trace", "synthetic", "--steps", "4", "--warmup", "2",
            "--prefill", "0", "--drafts", "3", "--acceptance", "1,0.5", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    spec = run["speculation"]
    assert spec["drafts"] == 3 and spec["plain_step_ms"] == pytest.approx(1e3 / run["tok_s"])
    full, half = spec["at"]
    assert full["tokens_per_step"] == 4 and half["tokens_per_step"] == pytest.approx(1.875)
    assert full["tok_s"] == pytest.approx(4e3 / spec["verify_step_ms"])
    assert half["vs_plain"] == pytest.approx(half["tok_s"] / run["tok_s"])
    assert spec["verify_miss_bytes_per_step"] > run["miss_bytes_per_token"] > 0  # 4 tokens' experts: more misses
    # what refused drafts cost, by the drafts a step keeps: less the more it keeps, nothing when it keeps all three
    if_kept = spec["refused_bytes_if_kept"]
    assert len(if_kept) == 4 and if_kept[0] > 0 and if_kept[-1] == 0
    assert all(a >= b for a, b in zip(if_kept, if_kept[1:]))
    assert full["refused_bytes_per_step"] == 0
    chance = [0.5, 0.25, 0.125, 0.125]  # 0, 1, 2 or 3 drafts kept at acceptance 0.5
    assert half["refused_bytes_per_step"] == pytest.approx(sum(p * b for p, b in zip(chance, if_kept)))
    cost = max(spec["verify_step_ms"] - spec["plain_step_ms"], 0) / 3 / spec["plain_step_ms"]
    assert spec["row_cost"] == pytest.approx(cost)
    for at in spec["at"]:  # the engine's turn-down at that acceptance, never below plain decoding in its model
        down = at["turned_down"]
        assert down["drafts"] == best_draft_count(at["acceptance"], cost, 3) and down["vs_plain"] >= 1.0
    assert "verify steps of 3 drafts" in capsys.readouterr().err
    assert main(argv[:-2] + ["--acceptance", "1.5"]) == 2
    assert "--acceptance '1.5': comma-separated rates in [0, 1]" in capsys.readouterr().err
