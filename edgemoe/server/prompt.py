"""A conversation's prompt text: the model's chat template, and what the template refuses done around it.

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
from edgemoe.tokenizer import Tokenizer


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
