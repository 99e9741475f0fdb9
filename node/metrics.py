"""Prometheus metrics of one node, on ``prometheus_client``.

    m = Metrics()                       # a registry of its own: several nodes in one process never collide
    sent = m.counter("coterie_sent_bytes_total", "Bytes sent to peers", ("kind",))
    sent.labels(kind="snapshot").inc(1024)
    m.counter("coterie_rounds_total", "Completed rounds").inc()
    m.gauge("coterie_peers", "Peers by state", ("state",)).labels(state="alive").set(3)
    lat = m.histogram("coterie_request_duration_seconds", "Latency", ("rpc",), buckets=(0.01, 0.1, 1))
    lat.labels(rpc="Pull").observe(0.05)
    text = m.render()                   # text exposition 0.0.4
    m.value("coterie_sent_bytes_total", kind="snapshot")   # one sample, read back (tests, views)

Every registry also carries ``coterie_build_info`` (versions of coterie, python, grpc, torch) and the
standard process and platform collectors (``process_*``, ``python_info``, ``python_gc_*``).
``parse_text``/``sample`` read an exposition back (tests, the testbed check).
"""

from __future__ import annotations

import functools
import platform
import re
from collections.abc import Iterable
from importlib import metadata

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.parser import text_string_to_metric_families

# `_created` timestamps per series double the exposition and no dashboard of ours reads them
prometheus_client.disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# classic names only: prometheus_client accepts any UTF-8 name now, most scrapers and PromQL don't
_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
DEFAULT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

__all__ = ["CONTENT_TYPE", "DEFAULT_BUCKETS", "Metrics", "build_info", "parse_text", "sample"]


@functools.cache  # a process's installed versions do not change; reading them scans site-packages
def _version(dist: str) -> str:  # (~30 ms each: a thousand in-process nodes paid it 3,000 times)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def build_info() -> dict[str, str]:
    """What this process runs: the labels of ``coterie_build_info``."""
    return {
        "version": _version("coterie"),
        "python": platform.python_version(),
        "grpcio": _version("grpcio"),
        "torch": _version("torch"),
    }


class Metrics:
    """One node's registry. Registering a name twice returns the existing metric when the type and
    label names match (and raises ValueError otherwise), so components may declare what they use."""

    def __init__(self, *, process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, tuple[type, tuple[str, ...], object]] = {}
        Info("coterie_build", "Versions this node runs", registry=self.registry).info(build_info())
        if process:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)

    def _register(self, cls: type, name: str, help: str, labelnames: Iterable[str] | str, **kw):
        labelnames = (labelnames,) if isinstance(labelnames, str) else tuple(labelnames)
        for n in (name, *labelnames):
            if not _NAME_RE.match(n):
                raise ValueError(f"invalid metric or label name {n!r} (in metric {name!r})")
        existing = self._metrics.get(name)
        if existing is not None:
            if existing[0] is not cls or existing[1] != labelnames:
                raise ValueError(
                    f"metric {name!r} already registered as {existing[0].__name__} with labels {list(existing[1])}"
                )
            return existing[2]
        metric = cls(name, help, labelnames, registry=self.registry, **kw)
        self._metrics[name] = (cls, labelnames, metric)
        return metric

    def counter(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Counter:
        return self._register(Counter, name, help, labelnames)

    def gauge(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Gauge:
        return self._register(Gauge, name, help, labelnames)

    def histogram(
        self, name: str, help: str, labelnames: Iterable[str] = (), buckets: Iterable[float] = DEFAULT_BUCKETS
    ) -> Histogram:
        return self._register(Histogram, name, help, labelnames, buckets=tuple(buckets))

    def value(self, sample_name: str, **labels: object) -> float | None:
        """The current value of one sample (``None`` if that series does not exist yet)."""
        return self.registry.get_sample_value(sample_name, {k: str(v) for k, v in labels.items()})

    def render(self) -> str:
        """Text exposition format 0.0.4."""
        return generate_latest(self.registry).decode()

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """Body and content type for a scrape with this Accept header (OpenMetrics when asked)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def parse_text(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of an exposition text: {(sample name, sorted label pairs): value}.
    Raises ValueError on a malformed line."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float | None:
    """Look one sample up in ``parse_text``'s result."""
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))
