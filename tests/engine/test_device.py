"""The compute dtype `--dtype auto` picks on the CPU (native bf16 and a model large enough, else float32), and the
start-up line that says what runs where (`edgemoe.engine.summary`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from edgemoe import LLM
from edgemoe.engine import device
from edgemoe.engine.device import CPU_BF16_MIN_PARAMS, native_cpu_bf16, resolve_dtype
from edgemoe.engine.summary import count, startup_line
from edgemoe.errors import EdgeMoEError
from edgemoe.models.registry import read_config

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "native, params, want",
    [
        ("AMX/AVX512-BF16", 1_868_000_000, torch.bfloat16),  # a 2-layer qwen3-30b-a3b
        ("AVX512-BF16", CPU_BF16_MIN_PARAMS, torch.bfloat16),
        ("AMX/AVX512-BF16", 12_649_472, torch.float32),  # the demo model: float32 decodes faster
        (None, 1_868_000_000, torch.float32),  # bf16 would be converted around every product
    ],
)
def test_auto_on_the_cpu(monkeypatch, native: str | None, params: int, want: torch.dtype) -> None:
    monkeypatch.setattr(device, "native_cpu_bf16", lambda: native)
    cfg, _ = read_config(Path(__file__).resolve().parents[2] / "edgemoe" / "demo_model")
    dtype, why = resolve_dtype("auto", CPU, cfg, params)
    assert dtype == want and why.startswith("auto: ")
    assert (native or "no native bfloat16") in why or "float32 decodes as fast" in why
    assert resolve_dtype("float32", CPU, cfg, params) == (torch.float32, "as asked")  # a name is never overridden
    with pytest.raises(EdgeMoEError, match="float16 is not supported on the cpu"):
        resolve_dtype("float16", CPU, cfg, params)


def test_native_bf16_is_what_the_cpu_flags_say() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo")
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split())
    assert (native_cpu_bf16() is not None) == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_count() -> None:
    assert [count(n) for n in (999, 12_649_472, 30_532_122_624)] == ["999", "12.6 M", "30.5 B"]


def test_startup_line_resident_and_offloaded(demo_llm) -> None:
    line = startup_line(demo_llm.engine)
    assert re.fullmatch(
        r"edgemoe: the demo model \(qwen2_moe\) on cpu, float32 \(as asked\): 12\.6 M parameters \(4\.4 M dense, "
        r"8\.3 M in experts\), all in RAM, context [\d,]+ tokens \([\d,]+ in the KV cache\), loaded in \d+\.\d s",
        line,
    ), line
    offloaded = LLM(progress=False, moe_strategy="offload", moe_cache_slots=16, max_num_seqs=1, max_model_len=64)
    line = startup_line(offloaded.engine)
    assert "(4.4 M dense, 8.3 M in experts: host banks, 16 of 224 in cache slots), all in RAM" in line, line
    assert ", context 64 tokens (64 in the KV cache), loaded in " in line, line
    assert "float32 (auto: " in line, line


def test_startup_line_names_quantized_experts(tmp_path) -> None:
    from edgemoe.tools.make_model import make_model

    folder = make_model(tmp_path / "m", "qwen3_moe", "tiny", dtype="float32")
    line = startup_line(LLM(str(folder), progress=False, expert_dtype="q8_0", max_num_seqs=1, max_model_len=64).engine)
    assert line.startswith("edgemoe: m (qwen3_moe) on cpu, float32 (auto: ") and " in Q8_0 experts), all in RAM" in line
