"""What a request requires of the answer, as a grammar (llguidance's Lark syntax; `engine/grammar.py` applies it as a
mask): a forced tool call (`tool_choice` required or a named function; Anthropic's any and tool) in the model's own
call format, or a structured output (a JSON schema, or any JSON object), or, with tools the model may call, either.

The answer may open with the model's reasoning where it reasons (a `<think>` block, or the rest of one the prompt
opened); then at most a few whitespace characters, then what is required. JSON is written on one line with `json`'s
separators (whitespace that the model could repeat without end is not allowed) and unsupported schema keywords are
ignored rather than refused (llguidance's lenient mode).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from edgemoe.server.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from edgemoe.server.protocol import RequestError
from edgemoe.server.reasoning import CLOSE, OPEN
from edgemoe.tokenizer import Tokenizer

if TYPE_CHECKING:  # (chat_format builds its answers' grammars here)
    from edgemoe.server.chat_format import ChatFormats

NL = "\n"
_JSON_OPTIONS = {"lenient": True, "whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def response_schema(response_format: dict | None, param: str) -> dict | None:
    """The JSON schema an OpenAI-style `response_format` requires (`{"type": "object"}` for json_object); None for
    text. `param` names the field in errors."""
    kind = (response_format or {"type": "text"}).get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    schema = (response_format.get("json_schema") or {}).get("schema", response_format.get("schema"))
    if kind != "json_schema" or not isinstance(schema, dict):
        raise RequestError(400, f"{param}: must be text, json_object or json_schema with a schema", param)
    return schema


def grammar(
    tok: Tokenizer,
    formats: ChatFormats,
    tools: list[dict],
    calls: str | None,
    schema: dict | None,
    parallel: bool,
    in_reasoning: bool,
) -> str | None:
    """The answer's grammar, or None when nothing is required. `calls`: which calls the answer must be ("required":
    any of `tools`, a tool's name: that one), "auto" where it may be calls (the tools usable) or the JSON of
    `schema`, None where no call may come."""
    if calls is None and schema is None:
        return None
    if formats.harmony:
        return _valid(_harmony(tok, tools, calls, schema), schema is not None and calls is None)
    rules = [f"answer: {'json' if calls is None else 'calls' if schema is None or calls != 'auto' else 'json | calls'}"]
    if schema is not None:
        rules.append(f"json: %json {_json(schema)}")
    if calls is not None:
        named = [t for t in tools if calls in ("required", "auto") or t["function"]["name"] == calls]
        rules += _calls(tok, formats, named, parallel)
    if formats.reasoning:  # the reasoning, then the answer
        if tok.added_token(CLOSE) is None:  # up to the closing text
            rules.append("think_body[suffix=" + json.dumps(CLOSE) + "]: /(.|\\n)*/")
        else:  # text, which the closing token is not
            rules.append(f"think_body: /(.|\\n)*/ {_lit(tok, CLOSE)}")
        rules.append(f"think: {_lit(tok, OPEN)} think_body")
        start = "think_body" if in_reasoning else "think?"
        rules.insert(0, f"start: {start} /[ \\t\\n]{{0,4}}/ answer")
    else:
        rules.insert(0, "start: answer")
    return _valid("\n".join(rules), schema is not None and calls is None)


def _valid(text: str, format_only: bool) -> str:
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        param = "response_format" if format_only else "tools"
        raise RequestError(400, f"{param}: cannot constrain the answer: {error.splitlines()[0]}", param)
    return text


def _harmony(tok: Tokenizer, tools: list[dict], calls: str | None, schema: dict | None) -> str:
    """Harmony's answer (`harmony.py`; the prompt ends with `<|start|>assistant`): an analysis message may come
    first, then one call on commentary addressed to one of the tools, JSON arguments and `<|call|>` (gpt-oss stops
    on that token), or the JSON of `schema` as the final message. One call a turn: the model stops at its end."""
    lit = {m: _lit(tok, m) for m in (CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START)}
    body = "/(.|\\n)*/ " + lit[END] if tok.added_token(END) is not None else "text[suffix=" + json.dumps(END) + "]"
    rules = [f"analysis: {lit[CHANNEL]} \"analysis\" {lit[MESSAGE]} {body} {lit[START]} \"assistant\"",
             "text: /(.|\\n)*/"]  # fmt: skip
    answers = []
    if calls is not None:
        named = [t for t in tools if calls in ("required", "auto") or t["function"]["name"] == calls]
        for i, t in enumerate(named):
            fn = t["function"]
            head = f"{lit[CHANNEL]} {json.dumps('commentary to=functions.' + fn['name'] + ' ')} {lit[CONSTRAIN]}"
            rules.append(f"args_{i}: %json {_json(fn.get('parameters') or {'type': 'object'})}")
            rules.append(f'call_{i}: {head} "json" {lit[MESSAGE]} args_{i} {lit[CALL]}')
        answers += [f"call_{i}" for i in range(len(named))]
    if schema is not None:
        rules.append(f"json: %json {_json(schema)}")
        answers.append(f'{lit[CHANNEL]} "final" {lit[MESSAGE]} json {lit[RETURN]}')
    return "\n".join(["start: analysis? answer", "answer: " + " | ".join(answers), *rules])


def _json(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def _lit(tok: Tokenizer, text: str) -> str:
    """A Lark literal for `text`: an added token (markup, which the grammar library keeps apart from text) by its id,
    other text as a string."""
    token = tok.added_token(text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def _calls(tok: Tokenizer, formats: ChatFormats, tools: list[dict], parallel: bool) -> list[str]:
    """Rules for `calls`: one call of one of `tools` in the model's format, or several where parallel calls are
    allowed."""
    rules = []
    for i, t in enumerate(tools):
        fn = t["function"]
        schema, name = fn.get("parameters") or {"type": "object"}, fn["name"]
        if formats.tool_parser in ("qwen3_coder", "glm"):
            rules += (_coder_call if formats.tool_parser == "qwen3_coder" else _glm_call)(tok, i, name, schema)
            continue
        head = {"name": name, "arguments": None}
        opening = json.dumps(head, ensure_ascii=False).removesuffix("null}")  # {"name": "f", "arguments":
        rules.append(f"args_{i}: %json {_json(schema)}")
        if formats.tool_parser == "mistral" and formats.mistral_v11:
            rules.append(f"call_{i}: {_lit(tok, '[TOOL_CALLS]')} {json.dumps(name)} {_lit(tok, '[ARGS]')} args_{i}")
        elif formats.tool_parser == "mistral":
            rules.append(f'call_{i}: {json.dumps(opening)} args_{i} "}}"')
        else:  # qwen: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
            body = f"{json.dumps(NL + opening)} args_{i} {json.dumps('}' + NL)}"
            rules.append(f"call_{i}: {_lit(tok, '<tool_call>')} {body} {_lit(tok, '</tool_call>')}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    if formats.tool_parser == "mistral" and not formats.mistral_v11:  # one list after one [TOOL_CALLS]
        more = ' (", " call)*' if parallel else ""
        rules.append(f'calls: {_lit(tok, "[TOOL_CALLS]")} " [" call{more} "]"')
    else:
        sep = '"\\n"' if formats.tool_parser in ("qwen", "qwen3_coder", "glm") else ""
        rules.append(f"calls: call ({sep} call)*" if parallel else "calls: call")
    return rules


def _glm_call(tok: Tokenizer, i: int, name: str, schema: dict) -> list[str]:
    """GLM-4.5's call: arguments among the schema's, each value any text up to its closing tag (the parser types it
    by the schema)."""
    props = list((schema.get("properties") or {}) if isinstance(schema, dict) else {})
    names = " | ".join(json.dumps(p) for p in props)
    key, value = (f"{_lit(tok, f'<{t}>')} {{}} {_lit(tok, f'</{t}>')}" for t in ("arg_key", "arg_value"))
    pair = f'{key.format(f"({names})")} "\\n" {value.format(f"value_{i}")} "\\n"'
    args = [f"arg_{i}: {pair}", f"value_{i}: /(.|\\n)*/"] if props else []
    body = f" arg_{i}*" if props else ""
    return args + [f"call_{i}: {_lit(tok, '<tool_call>')} {json.dumps(name + NL)}{body} {_lit(tok, '</tool_call>')}"]


def _coder_call(tok: Tokenizer, i: int, name: str, schema: dict) -> list[str]:
    """Qwen3-Coder's XML call: parameters among the schema's, each value any text up to its closing tag (the parser
    types it by the schema)."""
    props = list((schema.get("properties") or {}) if isinstance(schema, dict) else {})
    names = " | ".join(json.dumps(p) for p in props)
    value = f'value_{i}[suffix="\\n</parameter>\\n"]: /(.|\\n)*/'
    params = [f'param_{i}: "<parameter=" ({names}) ">\\n" value_{i}', value] if props else []
    body = f" param_{i}*" if props else ""
    function, end = json.dumps(f"{NL}<function={name}>{NL}"), json.dumps(f"</function>{NL}")
    return params + [f"call_{i}: {_lit(tok, '<tool_call>')} {function}{body} {end} {_lit(tok, '</tool_call>')}"]
