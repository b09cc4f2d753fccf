"""Prometheus metrics of the engine server (served at `/metrics` in the text format).

Each server owns its registry, so several apps (tests) never share counters. Names:

- `ddops_engine_requests_total{endpoint, method}`: generation requests accepted
- `ddops_engine_errors_total{endpoint, status}`: requests answered with an error
- `ddops_engine_generations_total{method, finish_reason}`: finished generations (stop, length,
  cancelled when the client left or the server stopped)
- `ddops_engine_prompt_tokens_total{method}`, `ddops_engine_generated_tokens_total{method}`
- `ddops_engine_acceptance_length{method}`: histogram of tokens committed per round (bonus
  included), the speculative decoders' tau
- `ddops_engine_inter_token_seconds{method}`: histogram of each generation's mean gap between
  its tokens after the first (vLLM's inter-token latency; beside other requests' rounds when
  several decode at once)
- `ddops_engine_decode_tokens_per_second{method}`, `ddops_engine_ttft_seconds{method}` (from
  the request's submission: its wait in the queue counts): histograms
- `ddops_engine_queue_waiting`: requests waiting for the worker
- `ddops_engine_requests_running`, `ddops_engine_requests_waiting`: gauges of the requests
  decoding now and of those waiting for a slot (vLLM's num_requests_running / _waiting)
- `ddops_engine_tree_budget{method}`: histogram of the nodes each round verified (auto's
  choices, engine/budgets.py; 0 is plain decoding)
- `ddops_engine_preemptions_total`: sequences preempted because the KV block pool ran short
  (each re-prefills what it had committed when readmitted; vLLM's num_preemptions)
- `ddops_engine_batch_size`, `ddops_engine_pass_tokens`: histograms of the sequences and of
  the tokens in each target pass of the scheduler (engine/scheduler.py)
- `process_cpu_seconds_total`, `process_resident_memory_bytes`, ...: Prometheus' standard
  process figures (the bench subtracts the engine's CPU from the machine's busy time)
- `ddops_engine_prefix_cache_queries_total`, `ddops_engine_prefix_cache_hits_total`: prompt
  tokens of the requests that asked the prefix cache, and the tokens it held (vLLM's pair:
  hits / queries is the hit rate)
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)
_SPEED_BUCKETS = (1, 5, 10, 25, 50, 100, 150, 200, 300, 500, 1000, 2000)
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_BUDGET_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 10, 12, 15, 16, 24, 32, 64)
_PASS_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = Counter(
            "ddops_engine_requests",
            "Generation requests accepted.",
            ["endpoint", "method"],
            registry=r,
        )
        self.errors = Counter(
            "ddops_engine_errors",
            "Requests answered with an error.",
            ["endpoint", "status"],
            registry=r,
        )
        self.generations = Counter(
            "ddops_engine_generations",
            "Finished generations.",
            ["method", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ddops_engine_prompt_tokens", "Prompt tokens processed.", ["method"], registry=r
        )
        self.generated_tokens = Counter(
            "ddops_engine_generated_tokens", "Tokens generated.", ["method"], registry=r
        )
        self.acceptance_length = Histogram(
            "ddops_engine_acceptance_length",
            "Tokens committed per decoding round, bonus token included.",
            ["method"],
            buckets=_ACCEPTANCE_BUCKETS,
            registry=r,
        )
        self.tree_budget = Histogram(
            "ddops_engine_tree_budget",
            "Nodes each round verified (auto's chosen budgets; 0: plain decoding).",
            ["method"],
            buckets=_BUDGET_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "ddops_engine_inter_token_seconds",
            "Mean gap between a generation's tokens after its first.",
            ["method"],
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.decode_speed = Histogram(
            "ddops_engine_decode_tokens_per_second",
            "Decode speed of each generation.",
            ["method"],
            buckets=_SPEED_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ddops_engine_ttft_seconds",
            "Time to first token of each generation, its wait in the queue included.",
            ["method"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "ddops_engine_prefix_cache_queries",
            "Prompt tokens of requests that asked the prefix cache.",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "ddops_engine_prefix_cache_hits",
            "Prompt tokens the prefix cache held (not prefilled).",
            registry=r,
        )
        self.queue_waiting = Gauge(
            "ddops_engine_queue_waiting", "Requests waiting for the engine worker.", registry=r
        )
        self.running = Gauge("ddops_engine_requests_running", "Requests decoding now.", registry=r)
        self.waiting = Gauge(
            "ddops_engine_requests_waiting", "Requests waiting for a slot.", registry=r
        )
        self.preemptions = Counter(
            "ddops_engine_preemptions",
            "Sequences preempted: the KV block pool ran short (each re-prefills later).",
            registry=r,
        )
        self.batch_size = Histogram(
            "ddops_engine_batch_size",
            "Sequences in each target pass.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.pass_tokens = Histogram(
            "ddops_engine_pass_tokens",
            "Tokens in each target pass (verify, ar and prefill tokens together).",
            buckets=_PASS_TOKEN_BUCKETS,
            registry=r,
        )

    def observe_pass(self, sequences: int, tokens: int) -> None:
        """One target pass of the scheduler: its sequences and tokens."""
        self.batch_size.observe(sequences)
        self.pass_tokens.observe(tokens)

    def observe_generation(
        self, method: str, prompt_tokens: int, result, finish_reason: str, ttft_s: float
    ) -> None:
        """Record one finished generation (an engine.decode.GenerationResult); `ttft_s` counts
        the time it waited in the queue."""
        self.generations.labels(method, finish_reason).inc()
        self.prompt_tokens.labels(method).inc(prompt_tokens)
        self.generated_tokens.labels(method).inc(len(result.output_ids))
        acceptance_length = self.acceptance_length.labels(method)  # one lookup, not one a round
        for accepted in result.acceptance_lengths:
            acceptance_length.observe(accepted)
        tree_budget = self.tree_budget.labels(method)
        for nodes in result.budgets or ():
            tree_budget.observe(nodes)
        self.decode_speed.labels(method).observe(result.decode_tokens_per_s)
        if result.decode_tokens_per_s > 0:
            self.inter_token.labels(method).observe(1 / result.decode_tokens_per_s)
        self.ttft.labels(method).observe(ttft_s)

    def observe_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_cache_queries.inc(queried_tokens)
        self.prefix_cache_hits.inc(hit_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
