"""A conversation's prompt: the model's chat template, what the template refuses done around it, and the answers the
model generated (kept by `replay.TurnStore`) put back as it generated them.

Replayed answers: a returned assistant message that the store knows is rendered by the template with a sentinel as
its content; the text from the end of the turn's header (the part of it that the answer's opening, the generation
prompt it continued, starts with) to the sentinel becomes that opening and the answer's own tokens. The prompt is
then tokenized in pieces: the text up to and including an opening (the same text as the earlier request's whole
prompt, so the same tokens), the answer's tokens, the text after. A template whose turn header cannot be aligned
with the opening gets the conversation as it is, without replay.

System messages after the first (an agent's reminders, Codex's developer messages, a mode that changes mid-session):
a template that renders them in place is left to do so. One that refuses them (Qwen3.5's "System message must be
at the beginning") gets the conversation in parts, so that everything before such a message is exactly what the
template renders for the conversation up to it (the previous turn's prompt, which the prefix cache holds):

    prompt = template(messages before it) + the template's system turn around its content + the rest

where the rest is what follows that turn when the template renders the whole conversation with the message as a
user message. The template's system turn is read off a one-message conversation; a template whose turns cannot be
told apart that way gets the message as a user message instead.
"""

from __future__ import annotations

import uuid

from edgemoe.errors import EdgeMoEError
from edgemoe.server.replay import Turn, TurnStore
from edgemoe.tokenizer import Tokenizer

Segments = list["str | Turn"]  # text to tokenize, and answers' tokens


def sentinel(tag: str) -> str:
    """A text no conversation holds and no template changes (no spaces, no markup), to find where content lands."""
    return f"edgemoe{tag}{uuid.uuid4().hex}"


def render_text(
    tok: Tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None, kwargs: dict
) -> str:
    """The prompt text of `messages` (dicts as templates take them), later system messages in place."""
    try:
        return tok.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
    except EdgeMoEError:
        later = [i for i, m in enumerate(messages) if i and m["role"] == "system"]
        if not later:
            raise
        refused = later
    k = refused[-1]
    marks = {i: sentinel("s") for i in refused}
    masked = [{"role": "user", "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    full = tok.apply_chat_template(masked, add_generation_prompt, tools, **kwargs)  # (still refused: the error)
    turns = _turns(tok, kwargs)
    at = full.find(marks[k])
    after = full[at + len(marks[k]) :] if at >= 0 else ""
    if turns is None or not after.startswith(turns[2]):  # no system turn to write: as a user message
        text = full
        for i, mark in marks.items():
            text = text.replace(mark, messages[i]["content"])
        return text
    before = render_text(tok, messages[:k], False, tools, kwargs)  # earlier refused ones in place, recursively
    system_open, system_close, user_close = turns
    return before + system_open + messages[k]["content"] + system_close + after[len(user_close) :]


def _turns(tok: Tokenizer, kwargs: dict) -> tuple[str, str, str] | None:
    """How the template writes a system turn (its text before and after the content, at the start of a
    conversation, less the BOS token) and what ends a user turn after its content; None if it does not tell."""
    mark = sentinel("t")
    try:
        alone = tok.apply_chat_template([{"role": "system", "content": mark}], False, None, **kwargs)
        head = tok.apply_chat_template([{"role": "system", "content": "x"}], False, None, **kwargs)
        user = tok.apply_chat_template(
            [{"role": "system", "content": "x"}, {"role": "user", "content": mark}], False, None, **kwargs
        )
    except EdgeMoEError:
        return None
    if alone.count(mark) != 1 or not user.startswith(head) or user.count(mark) != 1:
        return None
    system_open, system_close = alone.removeprefix(tok.bos_token or "").split(mark)
    return system_open, system_close, user.split(mark)[1]


def render(
    tok: Tokenizer,
    messages: list[dict],
    marks: dict[str, Turn],
    fallback: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    kwargs: dict,
) -> tuple[Segments, str | None]:
    """The prompt's pieces (`messages` with the answers behind `marks` replayed; `fallback`, the messages as they
    are, where they cannot be), and the generation prompt it ends with (None: none, or it cannot be told)."""
    text = render_text(tok, messages, add_generation_prompt, tools, kwargs)
    segments = splice(text, marks) if marks else [text]
    if segments is None:
        text = render_text(tok, fallback, add_generation_prompt, tools, kwargs)
        segments = [text]
    gen = generation_prompt(tok, kwargs) if add_generation_prompt else None
    return segments, gen if gen is not None and text.endswith(gen) else None


def replay_marks(messages: list[dict], turns: TurnStore | None) -> tuple[list[dict], dict[str, Turn]]:
    """`messages` with each assistant message the store knows (the last message aside: a continuation) given a
    sentinel as its only content, and the answer behind each sentinel."""
    masked, marks = list(messages), {}
    for i, m in enumerate(messages[:-1] if turns is not None else ()):
        turn = turns.find(m) if m["role"] == "assistant" else None
        if turn is not None:
            mark = sentinel("r")
            masked[i], marks[mark] = {"role": "assistant", "content": mark}, turn
    return masked, marks


def splice(text: str, marks: dict[str, Turn]) -> Segments | None:
    """The prompt's pieces: each sentinel and the turn header before it replaced by the answer's opening and tokens
    (and the template's end of the message by the turn's own, where they differ: `Turn.closing`); None if a
    sentinel is not where it can be replaced. The header: the text right before the sentinel that the opening
    starts with (ChatML's `<|im_start|>assistant\n`), or else the opening written whole before it with the
    message's own header between (harmony's `<|start|>assistant` then `<|channel|>final<|message|>`, which the
    answer's tokens hold as the model wrote them)."""
    out: Segments = []
    pos = 0
    for mark in sorted(marks, key=text.find):
        turn, at = marks[mark], text.find(mark)
        if at < pos or text.count(mark) != 1:
            return None
        head = next((k for k in range(min(len(turn.opening), at - pos), 0, -1)
                     if text.endswith(turn.opening[:k], pos, at)), 0)  # fmt: skip
        start = at - head
        if turn.opening and not head:
            start = text.rfind(turn.opening, pos, at)
            if start < 0:
                return None
        out += [text[pos:start] + turn.opening, turn]
        pos = at + len(mark)
        if turn.closing is not None and text.startswith(turn.closing[0], pos):
            out.append(turn.closing[1])
            pos += len(turn.closing[0])
    return [*out, text[pos:]]


def generation_prompt(tok: Tokenizer, kwargs: dict) -> str | None:
    """What the template adds to a conversation for the model to answer; None if that cannot be told."""
    probe = [{"role": "user", "content": "x"}]
    closed = tok.apply_chat_template(probe, False, None, **kwargs)
    opened = tok.apply_chat_template(probe, True, None, **kwargs)
    return opened[len(closed) :] if opened.startswith(closed) else None


def encode(tok: Tokenizer, segments: Segments, limit: int | None) -> list[int]:
    """The prompt's tokens. `limit`: refuse, before tokenizing, a prompt whose length alone proves it longer."""
    texts = [s for s in segments if isinstance(s, str)]
    if limit is not None:
        tok.check_length(sum(map(len, texts)), limit, sum(len(s.ids) for s in segments if isinstance(s, Turn)))
    ids: list[int] = []
    for s in segments:
        ids += s.ids.tolist() if isinstance(s, Turn) else tok.encode(s, add_special_tokens=False) if s else []
    return ids
