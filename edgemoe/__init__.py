"""edgemoe: run Mixture-of-Experts language models larger than the GPU's memory."""

from __future__ import annotations

from edgemoe.engine.engine import demo_model_path
from edgemoe.errors import EdgeMoEError
from edgemoe.llm import LLM
from edgemoe.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EdgeMoEError", "demo_model_path", "__version__"]
