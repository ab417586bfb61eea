"""The device and compute dtype a run uses, and why (the start-up line says it, `edgemoe.engine.summary`).

`--dtype auto` on CUDA is the checkpoint's dtype (bfloat16 becomes float16 on a GPU without it). On the CPU it is
bfloat16 where the CPU computes it natively (AMX or AVX512-BF16) and the model is large enough for decode to stream
its weights from RAM, else float32: small models decode faster in float32 (docs/findings.md, "bf16 on the CPU").
"""

from __future__ import annotations

import torch

from edgemoe.config import ModelConfig
from edgemoe.errors import EdgeMoEError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
CPU_BF16_MIN_PARAMS = 100_000_000  # below: float32 decodes as fast or faster (the weights stay in the caches)


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EdgeMoEError(f"unknown device {name!r}: use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EdgeMoEError("device cuda requested but CUDA is not available (no GPU, or a CPU build of torch)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise EdgeMoEError(f"no device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise EdgeMoEError(f"unsupported device {name!r}: use cpu or cuda")
    return device


def native_cpu_bf16() -> str | None:
    """The instructions this CPU computes bfloat16 with (AMX, AVX512-BF16), as torch's cpuinfo sees them; None:
    none (bf16 would be converted to float32 around every product)."""
    checks = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    found = [name for name, check in checks if getattr(torch.cpu, check, lambda: False)()]
    return "/".join(found) or None


def resolve_dtype(name: str, device: torch.device, cfg: ModelConfig, params: int) -> tuple[torch.dtype, str]:
    """The compute dtype of `--dtype name` for a model of `params` parameters on `device` -> (dtype, why)."""
    if name == "auto":
        return _auto(device, cfg, params)
    if name not in _DTYPES:
        raise EdgeMoEError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        raise EdgeMoEError("float16 is not supported on the cpu device: use float32 or bfloat16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise EdgeMoEError("this GPU cannot do bfloat16: use float16 or float32")
    return dtype, "as asked"


def _auto(device: torch.device, cfg: ModelConfig, params: int) -> tuple[torch.dtype, str]:
    if device.type == "cuda":
        wanted = _DTYPES.get(cfg.torch_dtype, torch.float32)
        if wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return torch.float16, "auto: the checkpoint's bfloat16, which this GPU lacks"
        return wanted, "auto: the checkpoint's"
    native = native_cpu_bf16()
    if native is None:
        return torch.float32, "auto: this CPU has no native bfloat16"
    if params < CPU_BF16_MIN_PARAMS:
        return torch.float32, f"auto: under {CPU_BF16_MIN_PARAMS // 10**6} M parameters float32 decodes as fast"
    return torch.bfloat16, f"auto: {native} on this CPU, faster from {CPU_BF16_MIN_PARAMS // 10**6} M parameters"
