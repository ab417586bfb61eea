"""What a grammar costs a decode step on the host: llguidance (as `engine/grammar.py` runs it) against xgrammar, on
the same vocabulary and the same grammars, per step and per grammar compile (CPU only).

    python benchmarks/grammar_cost.py --vocab ggml-vocab-qwen2.gguf [--repeats 5] [--threads 2] [--json OUT]

`--vocab`: a GGUF file whose tokenizer is read as edgemoe reads one (`GGUFCheckpoint.tokenizer`); Qwen2's 151,643-token
BPE (Qwen3's) is `vendor/llama.cpp/models/ggml-vocab-qwen2.gguf` of the llama-cpp-python 0.3.36 sdist. Without it,
the demo model's tokenizer, which says little about a real vocabulary. Both libraries build their tokenizer from the
same `tokenizer.json` (xgrammar through transformers' `PreTrainedTokenizerFast`). xgrammar is not an edgemoe
dependency: `pip install xgrammar` first.

Grammars, each the server's own (`server/constraints.py`): (a) `response_format` with a typed tool-call schema (an
enum, an integer, a nested array of objects), (b) one with free-form string fields, (c) a forced call of (a)'s tool
in Qwen3's `<tool_call>` format. xgrammar compiles the same Lark text, each `%json` rule handed over as xgrammar's
JSON-schema grammar with the same one-line separators. Each matcher is driven through a fixed valid answer (its
tokens from the same tokenizer): a step is consuming the previous token, then writing the next mask, the work
`GrammarConstraint` does per sequence and step. Batch 8: eight matchers of the grammar, their masks written one
after the other (as the engine does) or by the library's batch call on `--threads` threads. Compile: building a
request's matcher from grammar text (llguidance: `LLMatcher`; xgrammar: a compile with the cache off, then its
`GrammarMatcher`). Each repeat builds fresh matchers, as each request does. "engine call, applied": llguidance
through `GrammarConstraint` itself, the masks then applied to the step's logits (float32, CPU): what the engine's
step pays, whichever library wrote the masks. Masks are compared step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import llguidance
import llguidance.torch
import torch

from edgemoe.engine.engine import demo_model_path
from edgemoe.engine.grammar import GrammarConstraint
from edgemoe.engine.sequence import Sequence
from edgemoe.models.gguf import GGUFCheckpoint
from edgemoe.sampling_params import SamplingParams
from edgemoe.server import constraints
from edgemoe.server.chat_format import ChatFormats
from edgemoe.tokenizer import Tokenizer

try:
    import xgrammar as xgr
except ImportError:
    xgr = None

TOOL = {
    "name": "edit_file",
    "parameters": {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "mode": {"type": "string", "enum": ["replace", "insert", "append"]},
            "line": {"type": "integer"},
            "edits": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"old": {"type": "string"}, "new": {"type": "string"}, "all": {"type": "boolean"}},
                    "required": ["old", "new", "all"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["path", "mode", "line", "edits"],
        "additionalProperties": False,
    },
}
TOOL_ARGS = {
    "path": "src/app/handlers.py",
    "mode": "replace",
    "line": 42,
    "edits": [
        {"old": "def handle(request):", "new": "def handle(request, timeout=30):", "all": False},
        {"old": "return fetch(url)", "new": "return fetch(url, timeout=timeout)", "all": True},
    ],
}
REPORT = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "details": {"type": "string"},
        "labels": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "summary", "details", "labels"],
    "additionalProperties": False,
}
REPORT_ANSWER = {
    "title": "Decode stalls after the prefix cache evicts a shared block",
    "summary": "Requests sharing a long system prompt wait ~40 ms at their first decode step once the cache is full.",
    "details": "Steps to reproduce:\n1. Serve qwen3-30b-a3b with `--kv-cache 2GiB`.\n2. Send 8 requests that "
    'share a 6,000-token prompt ("You are a careful reviewer...").\n3. Watch the TTFT: p90 jumps from 180 ms to '
    "230 ms; the eviction runs on the step's critical path. Café, naïve, 東京: the report's text is not ASCII.",
    "labels": ["bug", "prefix-cache", "latency"],
}
QWEN3_CALL_TOKENS = {"[PAD151657]": "<tool_call>", "[PAD151658]": "</tool_call>"}
BATCHES = (1, 8)
COLUMNS = ("library", "batch", "masks", "compile ms", "median us/step", "p90 us/step", "max us", "answer ms",
           "median of a 5 / 10 ms step")  # fmt: skip


def load_tokenizer(vocab: Path | None) -> tuple[Tokenizer, str]:
    """The tokenizer of `vocab` (a GGUF file), Qwen3's call markup named, or the demo model's; and what it is."""
    if vocab is None or not vocab.is_file():
        tok = Tokenizer(demo_model_path())
        print(f"no vocabulary file at {vocab}: the demo model's tokenizer instead ({tok.vocab_size} tokens)")
        return tok, f"demo model ({tok.vocab_size} tokens)"
    tok = GGUFCheckpoint(vocab).tokenizer()
    doc = json.loads(tok.to_json())
    # Qwen3's vocabulary is Qwen2's, its added tokens named: Qwen2's file names the call markup's ids padding
    renamed = {a["content"]: a for a in doc["added_tokens"] if a["content"] in QWEN3_CALL_TOKENS}
    for old, added in renamed.items():
        added["content"] = QWEN3_CALL_TOKENS[old]
        doc["model"]["vocab"][added["content"]] = doc["model"]["vocab"].pop(old)
    tok = Tokenizer.from_json(json.dumps(doc), tok.config, vocab.name)
    return tok, f"{vocab.name} ({tok.vocab_size} tokens{', Qwen3 call tokens named' if renamed else ''})"


def cases(tok: Tokenizer) -> dict[str, tuple[str, str]]:
    """name -> (the server's grammar, a valid answer's text)."""
    formats = ChatFormats(tool_parser="qwen", reasoning=False, template_tools=True)
    tools = [{"type": "function", "function": TOOL}]
    call = json.dumps({"name": TOOL["name"], "arguments": TOOL_ARGS})
    return {
        "(a) tool-call schema": (
            constraints.grammar(tok, formats, [], None, TOOL["parameters"], False, False),
            json.dumps(TOOL_ARGS),
        ),
        "(b) free-form strings": (
            constraints.grammar(tok, formats, [], None, REPORT, False, False),
            json.dumps(REPORT_ANSWER, ensure_ascii=False),
        ),
        "(c) forced call, qwen format": (
            constraints.grammar(tok, formats, tools, TOOL["name"], None, False, False),
            f"<tool_call>\n{call}\n</tool_call>",
        ),
    }


class LLGuidance:
    """llguidance as the engine runs it: `GrammarConstraint`'s tokenizer and matchers."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer, stops: list[int], threads: int) -> None:
        self.vocab_size = tok.vocab_size
        self.constraint = GrammarConstraint(tok, tok.vocab_size, stops)
        self.executor = llguidance.LLExecutor(threads)

    def matchers(self, grammar: str, n: int) -> tuple[float, list]:
        """Seconds to build the first matcher, and `n` matchers."""
        start = time.perf_counter()
        first = self.constraint.matcher(grammar)
        seconds = time.perf_counter() - start
        return seconds, [first] + [self.constraint.matcher(grammar) for _ in range(n - 1)]

    def step(self, matchers: list, token: int | None, masks: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            if token is not None and not m.consume_tokens([token]):
                raise RuntimeError(f"llguidance refused token {token}: {m.get_error()}")
            m.unsafe_compute_mask_ptr(masks[i].data_ptr(), masks.shape[1] * 4)

    def step_batched(self, matchers: list, token: int | None, masks: torch.Tensor) -> None:
        pairs = [(m, token) for m in matchers]
        if token is not None and not all(llguidance.torch.consume_token_par(self.executor, pairs)):
            raise RuntimeError(f"llguidance refused token {token}")
        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], masks)


class XGrammar:
    """xgrammar on the same tokenizer.json, compiling the server's grammar text."""

    name = "xgrammar"

    def __init__(self, tok: Tokenizer, stops: list[int], threads: int) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import PreTrainedTokenizerFast

        self.vocab_size = tok.vocab_size
        hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.to_json()))
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads)

    def matchers(self, grammar: str, n: int) -> tuple[float, list]:
        start = time.perf_counter()
        lark, named = xgrammar_lark(grammar)
        compiled = self.compiler.compile_lark(lark, named_grammars=named)
        first = xgr.GrammarMatcher(compiled)
        seconds = time.perf_counter() - start
        return seconds, [first] + [xgr.GrammarMatcher(compiled) for _ in range(n - 1)]

    def step(self, matchers: list, token: int | None, masks: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            if token is not None and not m.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")
            m.fill_next_token_bitmask(masks, i)

    def step_batched(self, matchers: list, token: int | None, masks: torch.Tensor) -> None:
        if token is not None and not all(xgr.BatchGrammarMatcher.batch_accept_token(matchers, [token] * len(matchers))):
            raise RuntimeError(f"xgrammar refused token {token}")
        self.batch.batch_fill_next_token_bitmask(matchers, masks)


def xgrammar_lark(grammar: str) -> tuple[str, dict]:
    """The server's Lark grammar for xgrammar: each `rule: %json {...}` becomes `rule: @rule`, a JSON-schema grammar
    with the separators and whitespace the schema's `x-guidance` options (llguidance's) ask for."""
    named = {}

    def schema_rule(m: re.Match) -> str:
        schema = json.loads(m[2])
        options = schema.pop("x-guidance", {})
        named[m[1]] = xgr.Grammar.from_json_schema(
            schema,
            any_whitespace=options.get("whitespace_flexible", True),
            separators=(options.get("item_separator", ", "), options.get("key_separator", ": ")),
            strict_mode=False,  # the schema's own additionalProperties, as llguidance reads it
        )
        return f"{m[1]}: @{m[1]}"

    return re.sub(r"^(\w+): %json (.*)$", schema_rule, grammar, flags=re.M), named


Library = LLGuidance | XGrammar


def drive(lib: Library, grammar: str, ids: list[int], batch: int, batched: bool, stops: list[int]) -> dict:
    """One answer through `batch` fresh matchers: the compile's seconds, each step's, and row 0's masks."""
    compile_s, matchers = lib.matchers(grammar, batch)
    words = (lib.vocab_size + 31) // 32
    masks = torch.zeros(batch, words, dtype=torch.int32)  # [batch, vocab / 32], a bit per token
    seen = torch.zeros(len(ids) + 1, words, dtype=torch.int32)
    step = lib.step_batched if batched else lib.step
    steps = []
    for i in range(len(ids) + 1):  # the mask of each answer token, then the one where the answer may end
        token = ids[i - 1] if i else None
        start = time.perf_counter()
        step(matchers, token, masks)
        steps.append(time.perf_counter() - start)
        seen[i] = masks[0]
    if not any(allowed(seen[-1], t) for t in stops):
        raise RuntimeError(f"{lib.name}: no stop token allowed after the answer")
    return {"compile_s": compile_s, "steps_s": steps, "masks": seen}


def engine_call(lib: LLGuidance, grammar: str, ids: list[int], batch: int) -> dict:
    """One answer through `GrammarConstraint` itself: each step the sequences' masks, then their application to the
    step's logits (float32, on the CPU)."""
    seqs = [Sequence([0], SamplingParams(), None, None) for _ in range(batch)]
    for seq in seqs:
        lib.constraint.attach(seq, lib.constraint.matcher(grammar))
    steps = []
    for i in range(len(ids) + 1):
        for seq in seqs if i else ():
            seq.token_ids.append(ids[i - 1])
        logits = torch.zeros(batch, lib.vocab_size)
        start = time.perf_counter()
        lib.constraint(seqs, logits)
        steps.append(time.perf_counter() - start)
    return {"compile_s": None, "steps_s": steps}


def allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def token_set(mask: torch.Tensor, vocab: int) -> set[int]:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return set(torch.nonzero(bits.reshape(-1)[:vocab]).flatten().tolist())


def compare_masks(tok: Tokenizer, ids: list[int], ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    """Steps whose allowed tokens differ, grouped by the difference: (llguidance only, xgrammar only) -> steps."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i in range(ours.shape[0]):
        if torch.equal(ours[i], theirs[i]):
            continue
        a, b = token_set(ours[i], tok.vocab_size), token_set(theirs[i], tok.vocab_size)
        groups.setdefault((tuple(sorted(a - b)), tuple(sorted(b - a))), []).append(i)
    lines = []
    for (only_ll, only_xg), steps in sorted(groups.items(), key=lambda kv: kv[1][0]):
        at = ", ".join(repr(tok.decode(ids[:i])[-16:]) for i in steps[:3]) + (" ..." if len(steps) > 3 else "")
        show = [repr(tok.decode([t], skip_special_tokens=False)) for t in (only_ll + only_xg)[:8]]
        lines.append(f"  {len(steps)} step(s) after {at}: llguidance only {len(only_ll)}, xgrammar only "
                     f"{len(only_xg)}: {' '.join(show)}")  # fmt: skip
    differing = sum(len(s) for s in groups.values())
    return {"steps": ours.shape[0], "differing": differing, "groups": lines}


def summary(runs: list[dict]) -> dict:
    steps = [s * 1e6 for r in runs for s in r["steps_s"]]
    compiles = [r["compile_s"] * 1e3 for r in runs if r["compile_s"] is not None]
    return {
        "median_us": statistics.median(steps),
        "p90_us": statistics.quantiles(steps, n=10)[-1],
        "max_us": max(steps),
        "answer_ms": statistics.median(sum(r["steps_s"]) for r in runs) * 1e3,
        "compile_ms": statistics.median(compiles) if compiles else None,
    }


def measure(
    libs: tuple[LLGuidance, XGrammar], grammar: str, ids: list[int], repeats: int, stops: list[int]
) -> list[dict]:
    rows = []
    for batch in BATCHES:
        for batched in (False, True) if batch > 1 else (False,):
            for lib in libs:
                drive(lib, grammar, ids, batch, batched, stops)  # warm-up: what the process keeps across requests
                runs = [drive(lib, grammar, ids, batch, batched, stops) for _ in range(repeats)]
                mode = "batch call" if batched else "one by one"
                rows.append({"library": lib.name, "batch": batch, "mode": mode, **summary(runs)})
        runs = [engine_call(libs[0], grammar, ids, batch) for _ in range(repeats + 1)][1:]  # the first warms up
        rows.append({"library": "llguidance", "batch": batch, "mode": "engine call, applied", **summary(runs)})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        share = f"{r['median_us'] / 50:.1f}% / {r['median_us'] / 100:.1f}%"
        compile_ms = "" if r["compile_ms"] is None else f"{r['compile_ms']:.1f}"
        lines.append(f"| {r['library']} | {r['batch']} | {r['mode']} | {compile_ms} | {r['median_us']:.0f} "
                     f"| {r['p90_us']:.0f} | {r['max_us']:.0f} | {r['answer_ms']:.1f} | {share} |")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=Path, help="a GGUF file whose tokenizer to use (Qwen2's vocab file)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8), help="for the batch calls")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if xgr is None:
        sys.exit("grammar_cost.py: xgrammar is not installed (pip install xgrammar; not an edgemoe dependency)")
    torch.set_num_threads(1)
    tok, vocab = load_tokenizer(args.vocab)
    stops = sorted({t for t in (tok.eos_token_id, tok.added_token("<|im_end|>")) if t is not None})
    start = time.perf_counter()
    ours = LLGuidance(tok, stops, args.threads)
    middle = time.perf_counter()
    libs = (ours, XGrammar(tok, stops, args.threads))
    setup = {"llguidance": middle - start, "xgrammar": time.perf_counter() - middle}
    print(f"vocabulary: {vocab}; stop tokens {stops}; tokenizer setup: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in setup.items()))  # fmt: skip
    result = {"vocab": vocab, "setup_s": setup, "threads": args.threads, "cases": {}}
    for name, (grammar, text) in cases(tok).items():
        ids = tok.encode(text, add_special_tokens=False)
        rows = measure(libs, grammar, ids, args.repeats, stops)
        print(f"\n{name}: {len(ids)} answer tokens, {len(ids) + 1} masks, {args.repeats} repeats")
        print("\n".join(table(rows)))
        masks = [drive(lib, grammar, ids, 1, False, stops)["masks"] for lib in libs]
        diff = compare_masks(tok, ids, *masks)
        print(f"masks: {diff['differing']} of {diff['steps']} steps differ")
        print("\n".join(diff["groups"]))
        result["cases"][name] = {"answer_tokens": len(ids), "rows": rows, "masks": diff}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
