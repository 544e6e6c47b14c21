"""The gateway's Prometheus metrics, in a registry of its own (one per app, so several apps can
live in one process, as in the tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jetllm_gateway_requests",
            "HTTP requests answered, by endpoint and status (499: the client hung up)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "jetllm_gateway_ttft_seconds",
            "From the request's arrival to its first token",
            ["endpoint"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "jetllm_gateway_request_seconds",
            "From the request's arrival to its last byte",
            ["endpoint"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "jetllm_gateway_in_flight", "Generation requests being answered now", registry=self.registry
        )

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
