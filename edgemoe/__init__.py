"""edgemoe: run Mixture-of-Experts language models larger than the GPU's memory."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EdgeMoEError", "demo_model_path", "__version__"]

# The public names load on first use (PEP 562): `edgemoe --version` and `--help` import this package, and importing
# torch with it would cost them ~2 s.
_LAZY = {
    "LLM": "edgemoe.llm",
    "SamplingParams": "edgemoe.sampling_params",
    "EdgeMoEError": "edgemoe.errors",
    "demo_model_path": "edgemoe.engine.engine",
}

if TYPE_CHECKING:
    from edgemoe.engine.engine import demo_model_path
    from edgemoe.errors import EdgeMoEError
    from edgemoe.llm import LLM
    from edgemoe.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'edgemoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
