"""The router's counters as Prometheus metrics (`jetllm router --metrics-port`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .router import Router


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        r, s = self.router, self.router.stats
        labels = ["model", "router"]
        key = [r.model, r.name]
        decisions = CounterMetricFamily(
            "jetllm_router_decisions", "Jobs placed, by kind of reason", labels=[*labels, "reason"]
        )
        for reason, n in sorted(s.reasons.items()):
            decisions.add_metric([*key, reason], n)
        yield decisions
        for name, doc, value in (
            ("jetllm_router_directed", "Jobs addressed to one instance", s.directed),
            ("jetllm_router_prompt_tokens", "Prompt tokens of the jobs placed", s.prompt_tokens),
            (
                "jetllm_router_expected_cached_tokens",
                "Prompt tokens expected cached on the chosen instances (hit rate: over prompt tokens)",
                s.expected_cached_tokens,
            ),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(key, value)
            yield c
        gauges: tuple[tuple[str, str, float], ...] = (
            ("jetllm_router_hit_rate", "Expected cached over prompt tokens, since start", s.hit_rate),
            (
                "jetllm_router_decision_p50_us",
                "Median decision time of the last 10,000 jobs",
                s.percentile(0.5),
            ),
            (
                "jetllm_router_decision_p99_us",
                "p99 decision time of the last 10,000 jobs",
                s.percentile(0.99),
            ),
            ("jetllm_router_index_blocks", "Distinct blocks in the index", r.index.blocks),
            ("jetllm_router_index_slots", "(instance, rank) pairs in the index", r.index.slots),
            ("jetllm_router_instances", "Live instances of the model", len(r.instances)),
            ("jetllm_router_load_ranks", "Ranks with a load report kept", len(r.loads)),
            (
                "jetllm_router_kv_held_batches",
                "KV-event batches held for an instance the registry does not show yet",
                len(r.feed.early) if r.feed is not None else 0,
            ),
        )
        for name, doc, level in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(key, level)
            yield g
        if r.feed is not None:
            for name, value in r.feed.counters.items():
                c = CounterMetricFamily(f"jetllm_router_kv_{name}", f"KV-event feed: {name}", labels=labels)
                c.add_metric(key, value)
                yield c
        for name, value in r.loads.counters.items():
            c = CounterMetricFamily(f"jetllm_router_load_{name}", f"Load reports: {name}", labels=labels)
            c.add_metric(key, value)
            yield c
        skipped = CounterMetricFamily(
            "jetllm_router_kv_events_skipped",
            "KV events the index could not apply (malformed)",
            labels=labels,
        )
        skipped.add_metric(key, r.index.bad_events)
        yield skipped
