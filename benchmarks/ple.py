"""Per-layer embeddings (Gemma-4) by backend and sync mode (#33): decode tok/s of `gpu`, `host`, `disk` + host sync
and `disk` + wait sync through the whole engine (scheduler, sampler, graphs: the disk backend's rows need each step's
token ids on the host, so only the engine's own loop is honest), the VRAM the table no longer takes, the share of the
disk fill that wait sync hides, the gaps between kernels per stream with and without a captured wait, and the `gpu` and
`host` backends' steps kernel by kernel (where the host backend's time goes).

    python benchmarks/ple.py [--geometry gemma-4-e2b] [--tokens 64] [--folder DIR] [--profile 6] [--json OUT]

The model is random (a checkpoint written once into `--folder`, default a temporary directory): `gemma-4-e2b` is
transformers' `Gemma4TextConfig()` defaults, which its docstring calls similar to google/gemma-4-e2b-it (30 layers,
hidden 2,304, vocabulary and PLE vocabulary 262,144, 256 a layer: a 4.0 GB bf16 table); `tiny` is a smoke test that
runs on the CPU. Decode samples (temperature 1, one seed) so that every step asks for a new row, as real text does;
every backend computes the same rows, so all runs sample the same tokens.

Disk runs are timed twice: `cold`, after the checkpoint's pages were dropped from the page cache
(`posix_fadvise(DONTNEED)`; each new token's row is then a read from the drive), and `warm`, repeating the same
tokens with the pages cached. The hidden share of the fill is (t_disk_host - t_disk_wait) / (t_disk_host - t_gpu),
step times of the same run: what wait sync saves of what host sync adds to a step.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from edgemoe import LLM, SamplingParams
from edgemoe.tools.random_weights import tokenizer_files

GEOMETRIES = {
    "gemma-4-e2b": {},  # transformers' defaults
    "tiny": dict(
        vocab_size=8192, vocab_size_per_layer_input=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=16,
        sliding_window=16, max_position_embeddings=4096,
    ),
}  # fmt: skip
SHARD_BYTES = 2 << 30
WARM_STEPS = 4  # decode steps before timing (first replays, allocator)
# (name, ple_backend, ple_sync, cold): the decode runs, in this order
RUNS = [
    ("gpu", "gpu", "host", False),
    ("host", "host", "host", False),
    ("disk+host cold", "disk", "host", True),
    ("disk+wait cold", "disk", "wait", True),
    ("disk+host warm", "disk", "host", False),
    ("disk+wait warm", "disk", "wait", False),
    ("gpu again", "gpu", "host", False),  # drift over the runs
]
PROFILED = [("disk+wait", "disk", "wait"), ("host sync", "disk", "host")]  # a wait captured; none captured
BACKENDS_PROFILED = [("gpu", "gpu"), ("host", "host")]  # where a host-backend step's time goes, kernel by kernel


def write_checkpoint(folder: Path, geometry: str, device: torch.device) -> Path:
    """A random Gemma-4 text checkpoint in bf16 (tensors drawn on `device`), written once: reused if complete."""
    import transformers

    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.Gemma4TextConfig(**GEOMETRIES[geometry])
    config.dtype = "bfloat16"
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.Gemma4ForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator(device).manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shape in tqdm(shapes.items(), desc="writing the checkpoint", unit="tensor", leave=False):
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight") or name.endswith("scale"):
            t = 1 + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        elif "embed_tokens" in name:  # scaled by sqrt(hidden) in the model
            t = 0.03 * t
        else:
            t = t / math.sqrt(shape[-1])
        current[name] = t.to(torch.bfloat16).cpu()
        size += current[name].numel() * 2
        if size >= SHARD_BYTES:
            shards.append(current)
            save_file(current, str(folder / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            current, size = {}, 0
    if current:
        shards.append(current)
        save_file(current, str(folder / f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    weight_map = {k: f"model-{i + 1:05d}.safetensors" for i, s in enumerate(shards) for k in s}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    tokenizer, tokenizer_config = tokenizer_files("qwen2_moe")
    (folder / "tokenizer.json").write_text(tokenizer)
    (folder / "tokenizer_config.json").write_text(tokenizer_config)
    for f in folder.glob("*.safetensors"):  # on the drive, so that dropping the pages makes reads real
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    (folder / "done").write_text("")
    return folder


def drop_cached(folder: Path) -> None:
    """Drop the checkpoint's pages from the page cache (pages a process still maps stay)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_llm(folder: Path, device: torch.device, dtype: str, backend: str, sync_mode: str, tokens: int):
    return LLM(
        str(folder), device=device.type, dtype=dtype, progress=False, max_num_seqs=1, max_model_len=tokens + 64,
        prefix_cache=False, ple_backend=backend, ple_sync=sync_mode,
    )  # fmt: skip


def decode(llm: LLM, prompt: list[int], tokens: int, device: torch.device) -> tuple[float, list[int]]:
    """Seconds a decode step over `tokens` steps after the prefill and WARM_STEPS, and the tokens generated."""
    engine = llm.engine
    params = SamplingParams(max_tokens=WARM_STEPS + tokens + 1, temperature=1.0, seed=0, ignore_eos=True)
    seq = engine.add_request(prompt, params)
    while len(seq.output().token_ids) < WARM_STEPS + 1:
        engine.step()
    sync(device)
    start = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    sync(device)
    seconds = (time.perf_counter() - start) / tokens
    while engine.has_unfinished():
        engine.step()
    return seconds, seq.output().token_ids


def gaps(llm: LLM, prompt: list[int], steps: int) -> dict:
    """Inter-kernel gaps per stream over `steps` decode steps (`edgemoe.tools.profiler.summarize`)."""
    from edgemoe.tools.profiler import record, summarize

    engine = llm.engine
    params = SamplingParams(max_tokens=WARM_STEPS + 2 * steps + 4, temperature=1.0, seed=0, ignore_eos=True)
    seq = engine.add_request(prompt, params)
    while len(seq.output().token_ids) < WARM_STEPS + 1:
        engine.step()
    record(engine.step, 1)  # the profiler's set-up, discarded (docs/findings.md, "Graph upload policies ...")
    try:
        s = summarize(record(engine.step, steps), steps)
        keep = ("period_us", "busy_us", "gpu_us", "kernels", "streams", "top")
        out = {k: s[k] for k in keep}
    except ValueError as exc:
        out = {"error": str(exc)}
    while engine.has_unfinished():
        engine.step()
    return out


def release(device: torch.device) -> None:
    """Free what the last LLM left (the caller dropped its reference first)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="gemma-4-e2b", choices=list(GEOMETRIES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed a run (default 64)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--folder", type=Path, help="where the checkpoint is written (default: a temporary directory)")
    ap.add_argument("--profile", type=int, default=6, help="decode steps profiled per run (0: none)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    folder = write_checkpoint(a.folder or Path(tempfile.mkdtemp(prefix="edgemoe-ple-")), a.geometry, device)
    config = json.loads((folder / "config.json").read_text())
    vocab, layers, dim = (
        config["vocab_size_per_layer_input"],
        config["num_hidden_layers"],
        config["hidden_size_per_layer_input"],
    )
    prompt = torch.randint(config["vocab_size"], (a.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    budget = WARM_STEPS + a.tokens + 2 * max(a.profile, 1) + a.prompt + 8
    result = {
        "geometry": a.geometry, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cores": os.cpu_count(), "table_bytes": vocab * layers * dim * torch.finfo(getattr(torch, dtype)).bits // 8,
        "tokens": a.tokens, "runs": {}, "profile": {},
    }  # fmt: skip
    print(
        f"{a.geometry}: PLE table {result['table_bytes'] / 2**30:.2f} GiB ({vocab} x {layers} x {dim})", file=sys.stderr
    )
    reference = None
    for name, backend, sync_mode, cold in RUNS:
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        llm = make_llm(folder, device, dtype, backend, sync_mode, budget)
        vram = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else 0
        if cold:
            drop_cached(folder)
        seconds, tokens = decode(llm, prompt, a.tokens, device)
        same = reference is None or tokens == reference
        reference = reference or tokens
        result["runs"][name] = {"step_ms": seconds * 1e3, "tok_s": 1 / seconds, "vram_bytes": vram, "same": same}
        print(f"  {name:>15}: {1 / seconds:8.1f} tok/s, {seconds * 1e3:7.3f} ms a step, VRAM after load "
              f"{vram / 2**30:6.2f} GiB{'' if same else ', TOKENS DIFFER'}", file=sys.stderr)  # fmt: skip
        del llm
        release(device)
    runs = result["runs"]
    t_gpu = runs["gpu"]["step_ms"]
    for temp in ("cold", "warm"):
        host, wait = runs[f"disk+host {temp}"]["step_ms"], runs[f"disk+wait {temp}"]["step_ms"]
        added = host - t_gpu
        result[f"hidden_share_{temp}"] = (host - wait) / added if added > 0 else None
        print(f"  disk fill ({temp}): host sync adds {added:.3f} ms a step; wait sync hides "
              f"{(host - wait) / added if added > 0 else float('nan'):.2f} of it", file=sys.stderr)  # fmt: skip
    result["vram_saved_bytes"] = runs["gpu"]["vram_bytes"] - runs["host"]["vram_bytes"]
    print(f"  VRAM the table no longer takes: {result['vram_saved_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    if a.profile and device.type == "cuda":
        for name, backend, sync_mode in PROFILED:
            llm = make_llm(folder, device, dtype, backend, sync_mode, budget)
            graphs = llm.engine.runner.graphs
            uploaded = sum(bool(getattr(g, "uploaded", False)) for g in graphs.graphs.values()) if graphs else 0
            p = {**gaps(llm, prompt, a.profile), "graphs_uploaded": uploaded}
            result["profile"][name] = p
            streams = " ".join(
                f"[{s['role']} median {s['gap_median_us']:.2f} p90 {s['gap_p90_us']:.2f} us]"
                for s in p.get("streams", {}).values()
            )
            print(f"  profile {name:>10}: {p.get('period_us', 0):8.1f} us a step, "
                  f"{uploaded} graph(s) uploaded {streams}{p.get('error', '')}", file=sys.stderr)  # fmt: skip
            del llm
            release(device)
        for name, backend in BACKENDS_PROFILED:
            llm = make_llm(folder, device, dtype, backend, "host", budget)
            p = gaps(llm, prompt, a.profile)
            result["profile"][f"backend {name}"] = p
            print(f"  profile backend {name:>4}: {p.get('period_us', 0):8.1f} us a step, GPU busy "
                  f"{p.get('busy_us', 0):8.1f} us, first to last kernel {p.get('gpu_us', 0):8.1f} us"
                  f"{p.get('error', '')}", file=sys.stderr)  # fmt: skip
            for op in p.get("top", [])[:6]:
                print(f"      {op['us']:8.1f} us ({op['count']:.0f}x, adds {op['extends_us']:.1f}) {op['name']}",
                      file=sys.stderr)  # fmt: skip
            del llm
            release(device)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
