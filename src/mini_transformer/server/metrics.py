"""What /metrics exports, in Prometheus' text format (prometheus-client), under vLLM's names.

Every serving series carries vLLM's name and a `model_name` label, so vLLM's own Grafana dashboard,
routers and autoscalers (`vllm:num_requests_waiting`, the KV-cache usage) read this server unchanged;
series vLLM has no name for keep the project's `mini_transformer_` prefix (the pool in blocks, the KV
store tiers). One registry per server, so tests can run several servers in one process. The engine loop
thread sets the gauges after each step and observes the histograms when a request finishes;
prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VLLM = "vllm:"
OURS = "mini_transformer_"
# seconds: from a few milliseconds (a tiny model on a GPU) up to minutes (a long queue on a busy CPU)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)  # tokens, vLLM's 1-2-5
FINISH_REASONS = ("stop", "length", "abort", "error")
KV_TRANSFER_OUTCOMES = ("saved", "save_timed_out", "loaded", "timed_out")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        name = ["model_name"]

        def gauge(metric: str, doc: str):
            return Gauge(metric, doc, name, registry=r).labels(model_name)

        def counter(metric: str, doc: str):  # exported as ..._total (Prometheus' convention)
            return Counter(metric, doc, name, registry=r).labels(model_name)

        def histogram(metric: str, doc: str, buckets):
            return Histogram(metric, doc, name, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge(f"{VLLM}num_requests_running", "Requests in the engine's running batch")
        self.waiting = gauge(f"{VLLM}num_requests_waiting", "Requests queued, not yet running")
        # two names for one number: the dashboard's older one and vLLM's current one (routers read either)
        self.kv_usage = [gauge(f"{VLLM}gpu_cache_usage_perc", "KV cache usage: share of pool blocks in use (0..1)"),
                         gauge(f"{VLLM}kv_cache_usage_perc", "KV cache usage: share of pool blocks in use (0..1)")]
        self.preemptions = counter(f"{VLLM}num_preemptions", "Requests preempted (recomputed)")
        self.prompt_tokens = counter(f"{VLLM}prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter(f"{VLLM}generation_tokens", "Tokens generated")
        self.prefix_queries = counter(f"{VLLM}prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter(f"{VLLM}prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self._success = Counter(f"{VLLM}request_success", "Requests that ended, by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        for reason in FINISH_REASONS:  # each at 0 from the start, so a dashboard's rate() has a series
            self.finished(reason)
        self.ttft = histogram(f"{VLLM}time_to_first_token_seconds", "Arrival to first generated token",
                              LATENCY_BUCKETS)
        self.tpot = histogram(f"{VLLM}time_per_output_token_seconds",
                              "Mean gap between a request's generated tokens after the first", TOKEN_BUCKETS)
        self.itl = histogram(f"{VLLM}inter_token_latency_seconds", "Gap between two outputs of one request",
                             TOKEN_BUCKETS)
        self.e2e = histogram(f"{VLLM}e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS)
        self.queue_time = histogram(f"{VLLM}request_queue_time_seconds", "Arrival to first scheduled",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram(f"{VLLM}request_prefill_time_seconds", "First scheduled to first token",
                                      LATENCY_BUCKETS)
        self.decode_time = histogram(f"{VLLM}request_decode_time_seconds", "First token to last token",
                                     LATENCY_BUCKETS)
        self.prompt_len = histogram(f"{VLLM}request_prompt_tokens", "Prompt length of finished requests",
                                    LENGTH_BUCKETS)
        self.generation_len = histogram(f"{VLLM}request_generation_tokens",
                                        "Generated length of finished requests", LENGTH_BUCKETS)
        self.max_tokens = histogram(f"{VLLM}request_max_num_generation_tokens",
                                    "max_tokens asked for by finished requests", LENGTH_BUCKETS)
        self._add_own_series(r)
        self._published = {"preemptions": 0, "prefix_cache_hit_tokens": 0, "prefill_tokens_computed": 0}

    def _add_own_series(self, r: CollectorRegistry) -> None:
        """The series vLLM has no name for."""
        self.num_blocks = Gauge(f"{OURS}kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.blocks_in_use = Gauge(f"{OURS}kv_blocks_in_use", "KV cache blocks held by requests", registry=r)
        self.rejected = Counter(f"{OURS}requests_rejected", "Requests refused at the door, by HTTP status",
                                ["status"], registry=r)
        # the KV store (engine/kv_connector.py); all zero without --kv-store / --host-kv-bytes
        self.kv_loaded = Gauge(f"{OURS}kv_store_blocks_loaded", "KV blocks loaded into the pool, by tier",
                               ["tier"], registry=r)
        self.kv_saved = Gauge(f"{OURS}kv_store_blocks_saved", "Full KV blocks written to the tiers", registry=r)
        self.kv_hit_rate = Gauge(f"{OURS}kv_store_lookup_hit_rate",
                                 "Share of looked-up blocks (beyond the pool) a tier gave", registry=r)
        self.kv_bytes = Gauge(f"{OURS}kv_store_bytes", "K/V bytes moved: loaded into the pool, saved to the tiers",
                              ["direction"], registry=r)
        self.kv_errors = Gauge(f"{OURS}kv_store_errors", "Store calls that failed (down, timed out)", registry=r)
        self.kv_verify_failures = Gauge(f"{OURS}kv_store_verify_failures",
                                        "Entries refused by a check (checksum, fingerprint, token ids)", registry=r)
        # KV events for a router (engine/kv_events.py); all zero without --kv-events-endpoint
        self.kv_event_batches = Gauge(f"{OURS}kv_event_batches", "KV event batches published, or dropped "
                                      "because the publisher's queue was full", ["state"], registry=r)
        # prefill/decode across servers (server/kv_transfer.py): the producer's saves, the consumer's waits
        self.kv_transfer_waits = Counter(f"{OURS}kv_transfer_waits", "Prefill/decode hand-overs through the KV "
                                         "store, by outcome: saved, save_timed_out (producer); loaded, timed_out "
                                         "(consumer)", ["outcome"], registry=r)
        for outcome in KV_TRANSFER_OUTCOMES:  # each at 0 from the start
            self.kv_transfer_waits.labels(outcome)

    def finished(self, reason: str):
        """The request_success counter of one finish reason."""
        return self._success.labels(self.model_name, reason)

    def observe_output(self, handle, now: float) -> None:
        """A request (engine_loop.RequestHandle) got new tokens at `now`."""
        if handle.first_token_at is None:
            handle.first_token_at = now
            self.ttft.observe(now - handle.arrival)
        else:
            self.itl.observe(now - handle.last_output_at)
        handle.last_output_at = now

    def observe_finished(self, handle, reason: str, now: float) -> None:
        """vLLM's per-request histograms: lengths, and the request's life cut in queue, prefill, decode."""
        self.finished(reason).inc()
        self.e2e.observe(now - handle.arrival)
        self.prompt_len.observe(len(handle.prompt_ids))
        self.generation_len.observe(handle.n_output)
        self.max_tokens.observe(handle.params.max_tokens)
        if handle.scheduled_at is not None:
            self.queue_time.observe(handle.scheduled_at - handle.arrival)
        if handle.first_token_at is not None:
            self.prefill_time.observe(handle.first_token_at - (handle.scheduled_at or handle.arrival))
            self.decode_time.observe(now - handle.first_token_at)
            if handle.n_output > 1:
                self.tpot.observe((now - handle.first_token_at) / (handle.n_output - 1))

    def catch_up(self, stats: dict) -> None:
        """Add what the engine's own counters grew by since the last call to the Prometheus counters."""
        grown = {key: stats[key] - seen for key, seen in self._published.items()}
        self._published = {key: stats[key] for key in self._published}
        self.preemptions.inc(grown["preemptions"])
        self.prefix_hits.inc(grown["prefix_cache_hit_tokens"])
        self.prefix_queries.inc(grown["prefix_cache_hit_tokens"] + grown["prefill_tokens_computed"])

    def observe_pool(self, num_blocks: int, blocks_in_use: int) -> None:
        self.num_blocks.set(num_blocks)
        self.blocks_in_use.set(blocks_in_use)
        for gauge in self.kv_usage:
            gauge.set(blocks_in_use / num_blocks if num_blocks else 0.0)

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

    def observe_kv_events(self, published: int, dropped: int) -> None:
        self.kv_event_batches.labels("published").set(published)
        self.kv_event_batches.labels("dropped").set(dropped)

    def render(self) -> bytes:
        return generate_latest(self.registry)
