"""The worker's Prometheus endpoint: vLLM's own engine metrics (its stat logger registers them in
this process's default registry) next to the message plane's, read straight from the worker's
counters at scrape time so there is one source of truth."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .context import WorkerContext
from .kvevents import KvEventRelay
from .slots import Slots
from .state import Lifecycle

log = logging.getLogger(__name__)


class PlaneCollector(Collector):
    def __init__(
        self, ctx: WorkerContext, slots: Slots, lifecycle: Lifecycle, kv_events: KvEventRelay
    ) -> None:
        self._ctx = ctx
        self._slots = slots
        self._lifecycle = lifecycle
        self._kv = kv_events

    def collect(self) -> Iterator[Any]:
        ctx = self._ctx
        labels = ["model", "instance"]
        ids = [ctx.model, ctx.instance]
        jobs = CounterMetricFamily("jetllm_jobs", "Jobs by what happened to them", labels=[*labels, "event"])
        for event, n in ctx.counters.items():
            if event != "frames_sent":
                jobs.add_metric([*ids, event], n)
        yield jobs
        frames = CounterMetricFamily(
            "jetllm_frames_sent", "Reply frames published to producers", labels=labels
        )
        frames.add_metric(ids, ctx.counters.frames_sent)
        yield frames
        errors = CounterMetricFamily(
            "jetllm_errors", "Error frames sent, by error code", labels=[*labels, "code"]
        )
        for code, n in ctx.errors.items():
            errors.add_metric([*ids, str(code)], n)
        yield errors
        if ctx.prefills:
            prefills = CounterMetricFamily(
                "jetllm_prefills",
                "Prompts of a decode worker by where they were prefilled",
                labels=[*labels, "how"],
            )
            for how, n in ctx.prefills.items():
                prefills.add_metric([*ids, how], n)
            yield prefills
        relay = self._kv
        if relay.running:
            kv = CounterMetricFamily(
                "jetllm_kv_events",
                "KV-event relay: engine batches read, published, replayed, gaps, resyncs",
                labels=[*labels, "event"],
            )
            for event, n in relay.counters.items():
                kv.add_metric([*ids, event], n)
            yield kv
        for name, doc, value in (
            ("jetllm_in_flight", "Jobs held now (pulled, not yet settled)", self._slots.busy),
            ("jetllm_slots", "Jobs this worker runs at once", self._slots.total),
            (
                "jetllm_ready",
                "1 when the worker takes jobs (consumer bound, engine answered, awake)",
                int(self._lifecycle.ready),
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(ids, value)
            yield g


def serve_metrics(collector: Collector, port: int, addr: str = "0.0.0.0") -> str:
    """Start the endpoint (a daemon thread); returns its URL. Port 0 picks a free port."""
    REGISTRY.register(collector)
    server, _ = start_http_server(port, addr=addr)
    host = addr if addr not in ("0.0.0.0", "::") else _hostname()
    url = f"http://{host}:{server.server_port}/metrics"
    log.info("metrics at %s", url)
    return url


def _hostname() -> str:
    import socket

    return socket.gethostname()
