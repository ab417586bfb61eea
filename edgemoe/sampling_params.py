from __future__ import annotations

import math
import numbers
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
    grammar: str | None = None  # the output must follow it: llguidance's Lark syntax (`engine/grammar.py`)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not _int(self.max_tokens) or self.max_tokens < 1:
            raise EdgeMoEError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p"):
            if not isinstance(getattr(self, name), numbers.Real) or isinstance(getattr(self, name), bool):
                raise EdgeMoEError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise EdgeMoEError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise EdgeMoEError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _int(self.top_k) or self.top_k < -1:
            raise EdgeMoEError(f"top_k must be -1 (off) or an integer >= 0, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            raise EdgeMoEError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise EdgeMoEError("stop strings must be non-empty strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_int(t) for t in self.stop_token_ids):
            raise EdgeMoEError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise EdgeMoEError(f"grammar must be a string, got {type(self.grammar).__name__}")
        if self.seed is not None and (not _int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise EdgeMoEError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
