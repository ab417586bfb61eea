"""What a CUDA-graph capture records besides kernels: the participants its replays must serve.

Some work a captured step enqueues needs the host at replay time (the copy service serves the copy lists a step
posts; the PLE wait's filler releases the flag a step waits on). Whatever enqueues such work calls `participate`
with the object that will act (a `ReplayHook`); every capture open at that moment (`recording`) records it, and the
graph runs its hooks around each replay (`edgemoe.engine.cuda_graphs`). Outside a capture `participate` does
nothing. A leaf: the graph code names none of its participants, and they import nothing above them to take part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class ReplayHook(Protocol):
    """Work a replay of one graph needs around its launch. A hook may also set `needs_upload = True`: its graph's
    first launch must not block (the graph upload policy `auto` uploads it at capture)."""

    def before_replay(self) -> None: ...

    def after_replay(self) -> None: ...


_OPEN: list[list[ReplayHook]] = []  # the participants of each capture in progress


@contextlib.contextmanager
def recording() -> Iterator[list[ReplayHook]]:
    """Inside: the participants a capture gathers (its graph's replay hooks), in the order they joined."""
    hooks: list[ReplayHook] = []
    _OPEN.append(hooks)
    try:
        yield hooks
    finally:
        _OPEN.remove(hooks)


def participate(hook: ReplayHook) -> None:
    """`hook` must act around every replay of the graphs being captured now (once each); nothing outside a capture."""
    for hooks in _OPEN:
        if hook not in hooks:
            hooks.append(hook)
