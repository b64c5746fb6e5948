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

        # the KV store (engine/kv_connector.py); all zero without --kv-store / --host-kv-bytes
        self.kv_loaded = Gauge(f"{PREFIX}_kv_store_blocks_loaded", "KV blocks loaded into the pool, by tier",
                               ["tier"], registry=r)
        self.kv_saved = Gauge(f"{PREFIX}_kv_store_blocks_saved", "Full KV blocks written to the tiers", registry=r)
        self.kv_hit_rate = Gauge(f"{PREFIX}_kv_store_lookup_hit_rate",
                                 "Share of looked-up blocks (beyond the pool) a tier gave", registry=r)
        self.kv_bytes = Gauge(f"{PREFIX}_kv_store_bytes", "K/V bytes moved: loaded into the pool, saved to the tiers",
                              ["direction"], registry=r)
        self.kv_errors = Gauge(f"{PREFIX}_kv_store_errors", "Store calls that failed (down, timed out)", registry=r)
        self.kv_verify_failures = Gauge(f"{PREFIX}_kv_store_verify_failures",
                                        "Entries refused by a check (checksum, fingerprint, token ids)", registry=r)

    def observe_kv_store(self, stats) -> None:
        """Copy the engine's kv_store_* counters (present when it has a connector) into the gauges."""
        if "kv_store_lookups" not in stats:
            return
        for key, value in stats.items():
            if key.startswith("kv_store_blocks_loaded_"):
                self.kv_loaded.labels(key.removeprefix("kv_store_blocks_loaded_")).set(value)
        self.kv_saved.set(stats["kv_store_blocks_saved"])
        self.kv_hit_rate.set(stats["kv_store_lookup_hit_rate"])
        self.kv_bytes.labels("loaded").set(stats["kv_store_bytes_loaded"])
        self.kv_bytes.labels("saved").set(stats["kv_store_bytes_saved"])
        self.kv_errors.set(stats["kv_store_store_errors"])
        self.kv_verify_failures.set(stats["kv_store_verify_failures"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
