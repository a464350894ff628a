"""Prometheus metrics of a server (its own registry, so two servers in one process do not mix counts)."""
from __future__ import annotations

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        self.requests = Counter("helmc_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.finished_requests = Counter("helmc_finished_requests", "Generations by finish reason", ["reason"], registry=r)
        self.tokens = Counter("helmc_generated_tokens", "Tokens generated", registry=r)
        self.queue = Gauge("helmc_queue_requests", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("helmc_running_requests", "Requests in the running batch", registry=r)
        self.ttft = Histogram("helmc_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.rate = Histogram("helmc_decode_tokens_per_second", "Per request, tokens after the first per second",
                              buckets=RATE_BUCKETS, registry=r)

    def watch(self, engine) -> None:
        """Gauges read from the engine when scraped: KV pages its slot caches hold and the scheduler has reserved."""
        from prometheus_client import Gauge
        Gauge("helmc_kv_pages_in_use", "KV pages held by the slot caches", registry=self.registry).set_function(
            engine.model.pages_in_use)
        Gauge("helmc_kv_pages_reserved", "KV pages reserved by running requests", registry=self.registry).set_function(
            lambda: engine.scheduler.pages_in_use)
        moe = engine.model.session.gpu_moe()
        if moe is not None:       # a mixture of experts on a GPU stage: how often VRAM served the decode rows' experts
            base = moe.served(decode=True)              # from here: the warm-up's dummy rows are not requests'
            Gauge("helmc_moe_decode_expert_selections", "Selected (decode row, expert) pairs since the server started",
                  registry=self.registry).set_function(lambda: moe.served(decode=True)[0] - base[0])
            Gauge("helmc_moe_decode_vram_hits", "Of those, pairs whose expert was in VRAM",
                  registry=self.registry).set_function(lambda: moe.served(decode=True)[1] - base[1])

    def finished(self, reason: str, n_tokens: int, t_first: float, t_end: float) -> None:
        self.finished_requests.labels(reason).inc()
        self.tokens.inc(n_tokens)
        if n_tokens > 1 and t_end > t_first > 0:
            self.rate.observe((n_tokens - 1) / (t_end - t_first))

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
