"""Load test for a running `edgemoe serve`: time to first token and decode speed at several concurrencies.

    edgemoe serve --port 8000 &                      # any model, any device
    python benchmarks/load_server.py --url http://127.0.0.1:8000 --concurrency 1 2 4

At each concurrency C, C clients send streamed /v1/completions back to back (fixed length: ignore_eos) until
`--requests` (default 4 x C) have finished. Per request: TTFT = first text byte - send; decode tok/s =
(tokens - 1) / (last token - first token). Per level: the medians, p90 TTFT, and the aggregate tok/s (all
tokens / wall time). One warm-up request runs first (the first step of a fresh process is slow).
Prints a table, then the same figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


async def one_request(client: httpx.AsyncClient, model: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError("the stream carried no text")
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return {"ttft_s": first - start, "decode_tok_s": decode, "tokens": tokens}


async def run_level(url: str, headers: dict, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    results: list[dict] = []
    todo = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def worker() -> None:
            for _ in todo:
                results.append(await one_request(client, model, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = sorted(r["ttft_s"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ttft_median_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "decode_tok_s_per_request": statistics.median(r["decode_tok_s"] for r in results),
        "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
        "tokens_per_request": max_tokens,
    }


async def main(a: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    async with httpx.AsyncClient(base_url=a.url, headers=headers, timeout=30) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
        await one_request(client, model, 8)  # warm-up
    levels = []
    for c in a.concurrency:
        levels.append(await run_level(a.url, headers, model, c, a.requests or 4 * c, a.max_tokens))
    return {"url": a.url, "model": model, "prompt_chars": len(PROMPT), "levels": levels}


def print_table(report: dict) -> None:
    print(f"model {report['model']} at {report['url']}, {report['levels'][0]['tokens_per_request']} tokens/request")
    heads = ("conc", "reqs", "TTFT p50 ms", "TTFT p90 ms", "decode tok/s/req", "total tok/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (4, 5, 12, 12, 17, 12))))
    for lv in report["levels"]:
        print(f"{lv['concurrency']:>4} {lv['requests']:>5} {lv['ttft_median_ms']:>12.1f} {lv['ttft_p90_ms']:>12.1f} "
              f"{lv['decode_tok_s_per_request']:>17.1f} {lv['aggregate_tok_s']:>12.1f}")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (default: http://127.0.0.1:8000)")
    p.add_argument("--api-key", help="the server's --api-key, if it has one")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="levels (default: 1 2 4)")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 4 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: 128)")
    args = p.parse_args()
    try:
        report = asyncio.run(main(args))
    except (httpx.HTTPError, RuntimeError) as exc:
        sys.exit(f"load_server: error: {type(exc).__name__}: {exc}")
    print_table(report)
    print(json.dumps(report))
