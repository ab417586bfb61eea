"""The `edgemoe` command: generate, make-model, serve, cache-sim, bench. User errors print one line and exit 2;
errors of the machine (a file that cannot be read or written, memory) one line and exit 1; no traceback either way."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from edgemoe.config import EngineConfig, ExpertCacheConfig, add_flags, check_model_path, flag_values
from edgemoe.errors import EdgeMoEError
from edgemoe.server.cli import add_serve_parser  # argparse only: the web stack is imported by cmd_serve
from edgemoe.tools.presets import FAMILIES, PRESETS

GENERATE_DEFAULTS = {"max_num_seqs": 1}  # generate runs one sequence (and sizes the KV cache for it, cmd_generate)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (it would print the whole usage block, ~20 lines, above the message); its
    subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        print(f"edgemoe: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _engine_flags(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    add_flags(p.add_argument_group("engine"), EngineConfig, defaults)
    add_flags(p.add_argument_group("expert offload"), ExpertCacheConfig)


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return flag_values(a, EngineConfig) | flag_values(a, ExpertCacheConfig)


def build_parser() -> argparse.ArgumentParser:
    from edgemoe import __version__

    parser = _Parser(prog="edgemoe", description="Run Mixture-of-Experts language models.")
    parser.add_argument("--version", action="version", version=f"edgemoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text from a prompt, streamed to stdout",
        description="Generate text from PROMPT (or standard input, UTF-8), streamed as it is produced. The KV cache "
        "holds this one sequence: the prompt's tokens plus --max-tokens (unless --kv-cache-memory or "
        "--kv-cache-tokens says otherwise). Standard error gets what was reserved, then time to first token and "
        "decode speed.",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt (default: read standard input)")
    gen.add_argument("--chat", action="store_true", help="treat PROMPT as a user message; apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: 0.95)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (default: off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top prob")
    gen.add_argument(
        "--seed", type=int, help="seed of the sampling: the same seed gives the same text (default: a new one each run)"
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    _engine_flags(gen, GENERATE_DEFAULTS)

    mk = sub.add_parser(
        "make-model",
        help="write a random-weight checkpoint (tests, benchmarks)",
        description="Write a random-weight checkpoint in Hugging Face layout, with a tokenizer.",
    )
    mk.add_argument("out", type=Path, help="output folder")
    mk.add_argument("--family", default="qwen2_moe", help=f"{', '.join(FAMILIES)} (default: qwen2_moe)")
    mk.add_argument(
        "--size",
        default="tiny",
        help=f"{_sizes()} (default: tiny); tiny-k's expert rows are whole 256-weight blocks, as the K types need",
    )
    mk.add_argument("--layers", type=int, help="truncate to this many layers")
    mk.add_argument("--layout", default="per-expert", help="per-expert (Hub style) or fused (transformers 5)")
    mk.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    mk.add_argument("--format", default="hf", choices=("hf", "gguf"), help="hf (folder) or gguf (OUT/model.gguf)")
    mk.add_argument(
        "--expert-dtype",
        help="gguf experts: bf16, f16, f32, q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4, q4_k, q5_k, q6_k, q4_k_m (Q4_K, down "
        "Q6_K), mixed (layers alternate Q4_K, Q8_0) or tq2_0 (one the kernels do not read); default: --dtype",
    )
    mk.add_argument("--seed", type=int, default=0)
    add_serve_parser(sub, _engine_flags)

    sim = sub.add_parser(
        "cache-sim",
        help="replay a routing trace through the expert-cache policies",
        description="Replay a routing trace (--record-routing) with one pool of SLOTS shared by all layers; "
        "belady is Belady's MIN, the bound of any policy.",
    )
    sim.add_argument("trace", type=Path, help="routing trace, .npy int32 [steps, layers, top_k]")
    sim.add_argument("--slots", type=int, required=True, help="expert slots in the pool")
    sim.add_argument("--policy", default="lru,scored,belady", help="comma-separated (default: lru,scored,belady)")
    sim.add_argument("--json", action="store_true", help='print {policy: {"hits", "misses", "hit_rate"}}')
    _add_bench_parser(sub)
    return parser


def _sizes() -> str:
    """The presets by name, a real model's with its family (it fixes --family)."""
    return ", ".join(f"{name} ({g['family']})" if "family" in g else name for name, g in PRESETS.items())


def _add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="offloaded decode speed against the PCIe/HBM bound (GPU)",
        description="Offloaded decode at batch 1 on a random-weight model of a real geometry, "
        "against the bound t >= HBM bytes / HBM bw + missed bytes / PCIe bw, measured in the same run.",
    )
    b.add_argument("--geometry", default="qwen3-30b-a3b", help=f"{_sizes()} (default: qwen3-30b-a3b)")
    b.add_argument("--layers", type=int, help="truncate to this many layers (quick runs)")
    b.add_argument("--context", type=int, default=4096, help="tokens already in the KV cache (default: 4096)")
    b.add_argument(
        "--moe-strategy",
        default="offload",
        choices=["offload", "resident"],
        help="offload (default): experts in host banks behind a cache; resident: every expert on the device",
    )
    b.add_argument("--moe-cache-fraction", help="comma-separated fractions of all experts to cache (a sweep)")
    b.add_argument(
        "--vram-budget", help="size the cache from device memory budgets instead (comma-separated: a sweep), e.g. 8GiB"
    )
    b.add_argument("--moe-policy", default="lru,scored", help="comma-separated policies (default: lru,scored)")
    b.add_argument(
        "--moe-cpu-compute",
        default="off",
        help="comma-separated CPU splits of the misses, each a run: off (copy-only), auto, N (default: off)",
    )
    b.add_argument(
        "--moe-cpu-threads",
        help="comma-separated sizes of the CPU expert pool, each a run of every split (default: the physical cores)",
    )
    b.add_argument(
        "--ram-budget",
        help="comma-separated host memory budgets for the experts (a sweep), each a size (24GiB) or a fraction of "
        "them (0.25): the rest in an expert store on disk, read through the RAM tier (default: every expert in RAM)",
    )
    b.add_argument(
        "--expert-store",
        metavar="DIR",
        help="with --ram-budget: where the store is written (default: the cache folder)",
    )
    b.add_argument("--routing-trace", help="FILE (.npy from --record-routing) or 'synthetic' (default: the router)")
    b.add_argument("--steps", type=int, default=64, help="timed decode steps (default: 64)")
    b.add_argument("--warmup", type=int, default=32, help="decode steps before timing (default: 32)")
    b.add_argument(
        "--prewarm",
        type=int,
        default=256,
        help="with --routing-trace: trace steps run through the cache alone before decoding (default: 256)",
    )
    b.add_argument(
        "--prefill",
        default="512",
        help="comma-separated prompt lengths for the prefill timings, each a first (cold) and later (warm) prompt, "
        "after the engine's start-up warm-up (0: skip; default: 512)",
    )
    b.add_argument(
        "--no-warmup-prefill",
        dest="warmup_prefill",
        action="store_false",
        help="skip the engine's start-up warm-up before the prefill timings (the first prompt then compiles)",
    )
    b.add_argument("--mode", default="eager,graph", help="eager, graph (one CUDA graph per step) or both")
    b.add_argument(
        "--shared-expert-overlap",
        default="on",
        help="on, off or off,on: the shared expert on a side stream beside the miss copy (default: on)",
    )
    b.add_argument(
        "--drafts",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: also time verify steps of 1 + K rows and report the decode rate they give at "
        "--acceptance (default: 0, none)",
    )
    b.add_argument(
        "--acceptance",
        default="1.0,0.7,0.4",
        help="with --drafts: comma-separated rates at which each draft is accepted (default: 1.0,0.7,0.4)",
    )
    b.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="record N replayed graph steps: kernels, busy time, gaps, overlap",
    )
    b.add_argument("--device", default="cuda")
    b.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    b.add_argument(
        "--expert-dtype",
        default="auto",
        help="routed experts as GGUF blocks: q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, mxfp4 (random valid "
        "blocks); auto: --dtype",
    )
    b.add_argument("--json", type=Path, help="write the results here")
    b.add_argument("--plot", type=Path, help="PNG of tok/s against cache size (needs matplotlib)")


def cmd_generate(a: argparse.Namespace) -> None:
    from edgemoe import LLM, SamplingParams
    from edgemoe.engine.summary import startup_line

    prompt = _read_prompt(a.prompt)
    params = SamplingParams(  # checked here, before the weights load
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        stop=a.stop,
        ignore_eos=a.ignore_eos,
    )
    kwargs = _engine_kwargs(a)
    check_model_path(kwargs["model"])
    request = [{"role": "user", "content": prompt}] if a.chat else prompt
    if kwargs["kv_cache_memory"] == "auto" and kwargs["kv_cache_tokens"] is None:
        prompt_tokens = _count_tokens(kwargs["model"], request, a.chat)
        if prompt_tokens is not None:  # else the engine says what is wrong with the model folder
            kwargs["kv_cache_tokens"] = prompt_tokens + a.max_tokens
    llm = LLM(**kwargs)  # says what it loads, once the model's config and the flags are checked
    print(startup_line(llm.engine), file=sys.stderr, flush=True)
    start = time.perf_counter()
    first = now = start
    last = None
    for out in llm.stream(request, params, chat=a.chat):
        now = time.perf_counter()
        if last is None:
            first = now
        sys.stdout.write(out.delta)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    sys.stdout.flush()
    n = len(last.token_ids)
    decode = f"then {(n - 1) / (now - first):.1f} tok/s decode" if n > 1 and now > first else "no decode step"
    print(
        f"[{len(last.prompt_token_ids)} prompt tokens, first token after {first - start:.2f} s; {n} tokens, "
        f"{decode}; finish: {last.finish_reason}]",
        file=sys.stderr,
    )
    if a.moe_collect_stats:
        _print_moe_stats(llm.moe_stats())


def _read_prompt(arg: str | None) -> str:
    """PROMPT, or standard input, as text; bytes that are not UTF-8 are a user error (not a traceback deep in the
    tokenizer). Python hands over such an argument with surrogate escapes: they are turned back into the bytes."""
    if arg is not None:
        data, where = arg.encode("utf-8", "surrogateescape"), "PROMPT"
    elif sys.stdin is None or sys.stdin.isatty():
        data, where = b"", "standard input"
    else:
        data, where = getattr(sys.stdin, "buffer", sys.stdin).read(), "standard input"
        if isinstance(data, str):  # a text stream put in place of stdin (an embedding program, a test)
            data = data.encode("utf-8", "surrogateescape")
    try:
        prompt = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EdgeMoEError(f"{where} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    if not prompt:
        raise EdgeMoEError("no prompt: give PROMPT or pipe text to standard input")
    return prompt


def _count_tokens(model: str | None, request: str | list[dict], chat: bool) -> int | None:
    """The prompt's tokens, to size the KV cache before the engine is built (None: no tokenizer to read here)."""
    from edgemoe.engine.engine import demo_model_path
    from edgemoe.tokenizer import Tokenizer

    path = Path(model) if model else demo_model_path()
    if path.suffix == ".gguf" and path.is_file():
        from edgemoe.models.gguf import GGUFCheckpoint

        tok = GGUFCheckpoint(path).tokenizer()
    elif (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        tok = Tokenizer(path)
    else:
        return None
    return len(tok.encode_chat(request) if chat else tok.encode(request))


def _print_moe_stats(stats: dict) -> None:
    cols = ("accesses", "hits", "misses", "evictions", "bytes_copied", "cpu_computed")
    lines = [
        f"expert cache: {stats['slots']} slots, policy {stats['policy']}",
        "layer " + " ".join(f"{c:>12}" for c in cols),
    ]
    for row in [*stats["layers"], {**stats["total"], "layer": "all"}]:
        lines.append(f"{row['layer']:>5} " + " ".join(f"{row[c]:>12}" for c in cols))
    lines.append(f"hit rate {stats['total']['hit_rate']:.3f}")
    tier = stats.get("ram_tier")
    if tier is not None:
        read = "" if tier["read_GBps"] is None else f", {tier['read_GBps']:.2f} GB/s"
        lines.append(
            f"RAM tier: {tier['rows']} rows, {tier['accesses']} accesses, hit rate {tier['hit_rate']:.3f}, "
            f"{tier['reads']} experts read from disk ({tier['bytes_read'] / 2**20:.1f} MiB{read}"
            f"{', O_DIRECT' if tier['direct'] else ', buffered'})"
        )
    print("\n".join(lines), file=sys.stderr)


def cmd_make_model(a: argparse.Namespace) -> None:
    from edgemoe.tools.make_model import make_model

    if a.layers is not None and a.layers < 1:
        raise EdgeMoEError(f"--layers must be >= 1, got {a.layers}")
    start = time.perf_counter()
    out = make_model(
        a.out, a.family, a.size, a.layers, a.layout, a.seed, a.dtype, format=a.format, expert_dtype=a.expert_dtype
    )
    files = [out] if out.is_file() else [f for f in out.iterdir() if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    written = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    print(f"wrote {out} ({written} in {time.perf_counter() - start:.1f} s)")


def cmd_serve(a: argparse.Namespace) -> None:
    from edgemoe.server.cli import run_serve

    run_serve(a, _engine_kwargs(a))


def cmd_bench(a: argparse.Namespace) -> None:
    from edgemoe.tools.bench import cmd_bench as run

    run(a)


def cmd_cache_sim(a: argparse.Namespace) -> None:
    import json

    from edgemoe.tools.cache_sim import run

    results = run(a.trace, a.slots, [p.strip() for p in a.policy.split(",") if p.strip()], progress=not a.json)
    if a.json:
        print(json.dumps(results))
        return
    for policy, r in results.items():
        print(f"{policy:>8}: hit rate {r['hit_rate']:.4f} ({r['hits']} hits, {r['misses']} misses)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, which names its own --help
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        (sub.choices.get(args.command, parser) if sub else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        commands = {
            "generate": cmd_generate,
            "make-model": cmd_make_model,
            "serve": cmd_serve,
            "cache-sim": cmd_cache_sim,
            "bench": cmd_bench,
        }
        commands[args.command](args)
    except EdgeMoEError as exc:
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 141  # 128 + SIGPIPE, what the shell reports for a command killed by it
    except OSError as exc:  # a file the command reads or writes: missing, unreadable, disk full
        print(f"edgemoe: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print("edgemoe: error: out of memory", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
