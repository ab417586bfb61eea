"""What the model generated, kept so that a returned history is rendered with the same tokens.

An agent sends each turn's answer back in the next request: its tool calls parsed into JSON, its reasoning and text
split apart. The chat template re-renders them its own way (key order, spacing, numbers, reasoning dropped or
moved), so the next prompt would differ from the tokens the model generated from the first such answer on, and the
prefix cache would miss from there. The store keeps, for each answer the server gave, the tokens the model generated
(without the stop token, which the template writes again as the end of the turn) and the prompt text it continued
(the template's generation prompt, a prefill, a forced call's opening); `prompt.py` renders a returned assistant
message that matches one exactly (its call ids, names and arguments, its text, its reasoning or none) as that
opening and those tokens.

Bounded: at most `max_tokens` tokens in all and `max_age_s` seconds each, the least recently used first out.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from edgemoe.engine.sequence import RequestOutput


@dataclass(frozen=True)
class Turn:
    """An answer as the model generated it: the prompt's end it continued, and its tokens. `closing`: where the turn
    ends otherwise in a history than the template ends a returned message's text, (what the template writes after
    it, what goes there instead): harmony's tool-call turns end in `<|call|>`, its text in `<|end|>`."""

    opening: str
    ids: array  # int32 token ids, the stop token left out
    closing: tuple[str, str] | None = None


def turn_key(reasoning: str | None, content: str, calls: list[tuple[str, str, object]]) -> bytes:
    """An answer's identity as a client sends it back: its reasoning (None: left out), its text, and its calls as
    (id, name, arguments as an object). Surrounding whitespace does not count (clients and parsers trim it)."""
    parts = [None if reasoning is None else reasoning.strip(), content.strip(), [list(c) for c in calls]]
    text = json.dumps(parts, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def message_key(message: dict, with_reasoning: bool) -> bytes:
    """The key of an assistant message as the chat template takes it (arguments already objects)."""
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    reasoning = message.get("reasoning_content", "") if with_reasoning else None
    return turn_key(reasoning, message.get("content") or "", calls)


class TurnStore:
    """Thread-safe: answers are remembered on the event loop, looked up where prompts are rendered (worker
    threads)."""

    def __init__(self, max_tokens: int = 1 << 22, max_age_s: float = 3600.0) -> None:
        self.max_tokens, self.max_age_s = max_tokens, max_age_s
        self._turns: OrderedDict[bytes, tuple[Turn, float]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def remember(
        self, reasoning: str, content: str, calls: list[tuple[str, str, str]], output: RequestOutput, opening: str,
        closing: tuple[str, str] | None = None,
    ) -> None:  # fmt: skip
        """A finished answer (`calls`: id, name, arguments as JSON text; `closing`: as `Turn`'s). Only answers the
        model ended itself (its stop token) are kept: one cut by max_tokens or a stop string is not what the template
        ends the turn with."""
        if output.finish_reason != "stop" or isinstance(output.stop_reason, str) or not output.token_ids:
            return
        turn = Turn(opening, array("i", output.token_ids[:-1]), closing)
        parsed = [(ident, name, json.loads(arguments)) for ident, name, arguments in calls]
        keys = [turn_key(reasoning, content, parsed)]
        if parsed:  # a client that drops reasoning still sends the call ids back, which no other answer has
            keys.append(turn_key(None, content, parsed))
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._drop(key)
                self._turns[key] = (turn, now)
                self._tokens += len(turn.ids)
            while self._turns and (self._tokens > self.max_tokens or self._expired(next(iter(self._turns)), now)):
                self._drop(next(iter(self._turns)))

    def find(self, message: dict) -> Turn | None:
        """The answer an assistant message returns, if it is one the store keeps (unchanged)."""
        key = message_key(message, with_reasoning="reasoning_content" in message or not message.get("tool_calls"))
        now = time.monotonic()
        with self._lock:
            if key not in self._turns or self._expired(key, now):
                return None
            self._turns.move_to_end(key)
            return self._turns[key][0]

    def __len__(self) -> int:
        return len(self._turns)

    def _expired(self, key: bytes, now: float) -> bool:
        return now - self._turns[key][1] > self.max_age_s

    def _drop(self, key: bytes) -> None:
        entry = self._turns.pop(key, None)
        if entry is not None:
            self._tokens -= len(entry[0].ids)
