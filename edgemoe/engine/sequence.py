"""One request's state as it moves through the engine, and what the user gets back."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from edgemoe.sampling_params import SamplingParams
from edgemoe.tokenizer import IncrementalDetokenizer

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str  # generated text only
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    delta: str = ""  # text new since the previous step (streaming)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token id that matched; None: EOS

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        generator: torch.Generator | None,
        request_id: str | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.generator = generator
        self.detok = detok
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.draft: list[int] = []  # tokens drafted after token_ids, verified by this step (speculative decoding)
        self.block_table: list[int] = []
        self.num_cached = 0  # prompt tokens whose K/V came from the prefix cache
        self.num_hashed, self.prefix_hash = 0, None  # blocks the prefix cache knows, the last one's hash
        self.state_slot: int | None = None  # its slot in the state cache while running (models whose layers keep one)
        # the state cache's snapshot row it owns (its state at a block boundary), and that boundary
        self.snapshot_row: int | None = None
        self.snapshot_tokens = 0
        self.text = ""
        self.emitted = 0  # characters of text already handed out
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def step_ids(self, start: int, n: int) -> list[int]:
        """The n tokens a step computes from `start`: its tokens, then its draft's."""
        if not self.draft:
            return self.token_ids[start : start + n]
        return (self.token_ids + self.draft)[start : start + n]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def output(self) -> RequestOutput:
        """Snapshot for the caller; the delta withholds text that could still become a stop string."""
        hold = 0 if self.finish_reason else max((len(s) - 1 for s in self.params.stop), default=0)
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return RequestOutput(
            self.request_id,
            self.token_ids[: self.num_prompt_tokens],
            self.output_ids,
            self.text,
            self.finish_reason,
            delta,
            cached_tokens=self.num_cached,
            stop_reason=self.stop_reason,
        )
