from __future__ import annotations

import math
from dataclasses import dataclass, field

from edgemoe.errors import EdgeMoEError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens reach the text (Mistral's [TOOL_CALLS] must)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise EdgeMoEError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise EdgeMoEError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise EdgeMoEError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise EdgeMoEError(f"top_k must be -1 (off) or an integer >= 0, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            raise EdgeMoEError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EdgeMoEError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
