"""What /metrics exports, in Prometheus' text format (prometheus-client). One registry per server, so
tests can run several servers in one process. The engine loop thread sets the gauges after each step
and observes the histograms when a request finishes; prometheus-client's metrics are thread-safe."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "mini_transformer"
# seconds: from a few milliseconds (a tiny model on a GPU) up to minutes (a long queue on a busy CPU)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(f"{PREFIX}_num_requests_running", "Requests in the engine's running batch", registry=r)
        self.waiting = Gauge(f"{PREFIX}_num_requests_waiting", "Requests queued, not yet running", registry=r)
        self.num_blocks = Gauge(f"{PREFIX}_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.blocks_in_use = Gauge(f"{PREFIX}_kv_blocks_in_use", "KV cache blocks held by requests", registry=r)
        self.prefix_hit_rate = Gauge(
            f"{PREFIX}_prefix_cache_hit_rate",
            "Share of prompt tokens found in the prefix cache (not computed) since start", registry=r)
        # a count that only grows: a Counter, exported as ..._preemptions_total (Prometheus' convention)
        self.preemptions = Counter(f"{PREFIX}_preemptions", "Requests preempted (recomputed)", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean gap between a request's generated tokens after the first",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused at the door, by HTTP status",
                                ["status"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
