"""`Metrics`: the Prometheus registry of one daemon (never the process-wide default one, so that
two daemons in one process, or a test, never share counters) and its metric families, named
`<prefix>_<name>`. HealthServer serves the registry at GET /metrics."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


class Metrics:
    def __init__(self, prefix: str, registry: CollectorRegistry | None = None) -> None:
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"{self.prefix}_{name}", doc, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        return Histogram(f"{self.prefix}_{name}", doc, list(labels), buckets=tuple(buckets), registry=self.registry)
