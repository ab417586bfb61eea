"""Prometheus metrics of one server, in their own registry (so that tests and embedders get no globals).

Gauges, latencies and finish counts are per sequence (a request with `n` choices runs `n`); prompt tokens
are per request, as `usage` reports them. The engine thread writes all but the error counter (the event
loop's); prometheus-client's metrics are thread-safe, and /metrics renders them on the event loop.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# 5 ms .. 60 s: a CPU demo step is ~5 ms, a long prompt on a big offloaded model takes seconds
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_TOKEN_LATENCY = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("edgemoe_num_requests_running", "Sequences being decoded", registry=r)
        self.waiting = Gauge("edgemoe_num_requests_waiting", "Sequences admitted but not yet running", registry=r)
        self.kv_usage = Gauge("edgemoe_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=r)
        self.prefix_queried = Counter("edgemoe_prefix_cache_queried_tokens", "Prompt tokens looked up", registry=r)
        self.prefix_hits = Counter("edgemoe_prefix_cache_hit_tokens", "Prompt tokens found in the cache", registry=r)
        self.prefix_hit_rate = Gauge("edgemoe_prefix_cache_hit_rate", "Hit tokens / queried tokens", registry=r)
        self._prefix_seen = (0, 0)  # the engine's totals at the last update
        self.prompt_tokens = Counter("edgemoe_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("edgemoe_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "edgemoe_sequences_finished",
            "Sequences that ended, by finish reason "
            "(stop, length, abort: the client left, error: the server stopped or failed)",
            ["finish_reason"],
            registry=r,
        )
        self.errors = Counter("edgemoe_request_errors", "Error responses, by HTTP status", ["status"], registry=r)
        self.ttft = Histogram(
            "edgemoe_time_to_first_token_seconds", "Arrival to first generated token", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "edgemoe_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            buckets=_TOKEN_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "edgemoe_e2e_request_latency_seconds",
            "Arrival to the last token of a sequence",
            buckets=_LATENCY,
            registry=r,
        )
        self._hit_rate: Gauge | None = None
        self._misses: Gauge | None = None
        self._speculative: tuple[Gauge, Gauge, Gauge] | None = None
        self._refused: Gauge | None = None
        self.ready = Gauge("edgemoe_ready", "1 once the model is loaded and the server accepts requests", registry=r)

    def prefix_cache(self, queried: int, hits: int) -> None:
        """The engine's running totals of prefix-cache look-ups, as counters and their ratio."""
        seen_queried, seen_hits = self._prefix_seen
        self.prefix_queried.inc(queried - seen_queried)
        self.prefix_hits.inc(hits - seen_hits)
        self._prefix_seen = (queried, hits)
        self.prefix_hit_rate.set(hits / queried if queried else 0.0)

    def expert_cache_hit_rate(self) -> Gauge:
        """Created on first use: only a server whose engine counts expert-cache hits (offload with
        --moe-collect-stats) exports it, so that no dashboard reads a 0 that was never measured."""
        if self._hit_rate is None:
            doc = "Expert-cache hits / accesses since start, all MoE layers (offload with --moe-collect-stats)"
            self._hit_rate = Gauge("edgemoe_expert_cache_hit_rate", doc, registry=self.registry)
        return self._hit_rate

    def expert_cache_misses(self) -> Gauge:
        """Created on first use, as the hit rate: misses since start, all MoE layers, by how they were served (copied
        to the device, or computed on the CPU: --moe-cpu-compute)."""
        if self._misses is None:
            doc = "Expert-cache misses since start, all MoE layers, by how they were served (offload with stats)"
            self._misses = Gauge("edgemoe_expert_cache_misses", doc, ["served"], registry=self.registry)
        return self._misses

    def refused_draft_bytes(self) -> Gauge:
        """Created on first use, as the hit rate: bytes of missed experts that only refused drafts routed to (offload
        with --moe-collect-stats and --speculative)."""
        if self._refused is None:
            doc = "Bytes of experts missed only for drafted rows the model refused, since start (offload with stats)"
            self._refused = Gauge("edgemoe_spec_decode_refused_expert_bytes", doc, registry=self.registry)
        return self._refused

    def speculative(self, steps: int, drafted: int, accepted: int) -> None:
        """Speculative decoding's totals since start (created on first use: only a server that drafts exports them)."""
        if self._speculative is None:
            r = self.registry
            self._speculative = (
                Gauge("edgemoe_spec_decode_verify_steps", "Sequence steps that verified drafts", registry=r),
                Gauge("edgemoe_spec_decode_draft_tokens", "Tokens drafted (--speculative)", registry=r),
                Gauge("edgemoe_spec_decode_accepted_tokens", "Drafted tokens accepted", registry=r),
            )
        for gauge, value in zip(self._speculative, (steps, drafted, accepted)):
            gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
