"""A small, dependency-free Prometheus registry (text exposition format 0.0.4).

    m = Metrics()
    sent = m.counter("coterie_bytes_sent_total", "Bytes sent to peers", ("kind",))
    sent.labels(kind="snapshot").inc(1024)
    rounds = m.counter("coterie_rounds_total", "Completed rounds")
    rounds.inc()
    peers = m.gauge("coterie_peers", "Peers by state", ("state",))
    peers.labels(state="alive").set(3)
    lat = m.histogram("coterie_request_seconds", "Request latency", ("rpc",), buckets=(0.01, 0.1, 1))
    lat.labels(rpc="Pull").observe(0.05)
    text = m.render()

Every update takes the registry's lock: transport threads and the event loop update it
concurrently. ``parse_text`` reads the format back (tests, and the launcher's byte totals).
"""
from __future__ import annotations

import math
import re
import threading
import time
from contextlib import contextmanager
from typing import Iterator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelKey = tuple[str, ...]


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _labelstr(pairs: list[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, registry: "Metrics", name: str, help: str, labelnames: tuple[str, ...]):
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for ln in labelnames:
            if not _LABEL_RE.match(ln) or ln.startswith("__"):
                raise ValueError(f"invalid label name {ln!r} for metric {name!r}")
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = registry._lock
        self._children: dict[LabelKey, object] = {}

    def _key(self, labels: dict[str, object]) -> LabelKey:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name!r} takes labels {list(self.labelnames)}, "
                             f"got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _new_child(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def labels(self, **labels: object):
        key = self._key(labels)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
            return child

    def _default(self):
        if self.labelnames:
            raise ValueError(f"metric {self.name!r} has labels {list(self.labelnames)}: "
                             "use .labels(...)")
        return self.labels()

    def _samples(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines += self._samples()
        return "\n".join(lines)


class _Value:
    __slots__ = ("_lock", "v")

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self.v = 0.0


class _CounterChild(_Value):
    def inc(self, n: float = 1.0) -> None:
        if n < 0:
            raise ValueError("a counter can only increase")
        with self._lock:
            self.v += n


class _GaugeChild(_Value):
    def set(self, v: float) -> None:
        with self._lock:
            self.v = float(v)

    def inc(self, n: float = 1.0) -> None:
        with self._lock:
            self.v += n

    def dec(self, n: float = 1.0) -> None:
        with self._lock:
            self.v -= n


class Counter(_Metric):
    kind = "counter"

    def _new_child(self) -> _CounterChild:
        return _CounterChild(self._lock)

    def inc(self, n: float = 1.0) -> None:
        self._default().inc(n)

    def value(self, **labels: object) -> float:
        """Current value (0 for a label set never touched)."""
        with self._lock:
            c = self._children.get(self._key(labels))
            return c.v if c is not None else 0.0

    def _samples(self) -> list[str]:
        with self._lock:
            items = sorted((k, c.v) for k, c in self._children.items())
        return [f"{self.name}{_labelstr(list(zip(self.labelnames, k)))} {_fmt(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild(self._lock)

    def set(self, v: float) -> None:
        self._default().set(v)

    def dec(self, n: float = 1.0) -> None:
        self._default().dec(n)

    def inc(self, n: float = 1.0) -> None:
        self._default().inc(n)


class _HistogramChild:
    __slots__ = ("_lock", "upper", "counts", "sum", "count")

    def __init__(self, lock: threading.RLock, upper: tuple[float, ...]):
        self._lock = lock
        self.upper = upper
        self.counts = [0] * len(upper)  # non-cumulative; rendered cumulatively
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        v = float(v)
        with self._lock:
            for i, ub in enumerate(self.upper):
                if v <= ub:
                    self.counts[i] += 1
                    break
            self.sum += v
            self.count += 1

    @contextmanager
    def time(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - t0)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry: "Metrics", name: str, help: str, labelnames: tuple[str, ...],
                 buckets: tuple[float, ...] = DEFAULT_BUCKETS):
        if "le" in labelnames:
            raise ValueError("'le' is reserved for histogram buckets")
        super().__init__(registry, name, help, labelnames)
        ub = sorted(float(b) for b in buckets)
        if len(set(ub)) != len(ub):
            raise ValueError(f"histogram {name!r}: duplicate buckets")
        if not ub or not math.isinf(ub[-1]):
            ub.append(math.inf)
        self.buckets = tuple(ub)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._lock, self.buckets)

    def observe(self, v: float) -> None:
        self._default().observe(v)

    def time(self):
        return self._default().time()

    def count(self, **labels: object) -> int:
        with self._lock:
            c = self._children.get(self._key(labels))
            return c.count if c is not None else 0

    def sum(self, **labels: object) -> float:
        with self._lock:
            c = self._children.get(self._key(labels))
            return c.sum if c is not None else 0.0

    def _samples(self) -> list[str]:
        with self._lock:
            items = sorted((k, list(c.counts), c.sum, c.count) for k, c in self._children.items())
        out = []
        for k, counts, s, n in items:
            pairs = list(zip(self.labelnames, k))
            acc = 0
            for ub, c in zip(self.buckets, counts):
                acc += c
                out.append(f"{self.name}_bucket{_labelstr(pairs + [('le', _fmt(ub))])} {acc}")
            out.append(f"{self.name}_sum{_labelstr(pairs)} {_fmt(s)}")
            out.append(f"{self.name}_count{_labelstr(pairs)} {n}")
        return out


class Metrics:
    """The registry. Registering a name twice returns the existing metric when it matches."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._metrics: dict[str, _Metric] = {}

    def _register(self, cls: type, name: str, help: str, labelnames, **kw) -> _Metric:
        labelnames = (labelnames,) if isinstance(labelnames, str) else tuple(labelnames)
        with self._lock:
            existing = self._metrics.get(name)
            if existing is not None:
                if type(existing) is not cls or existing.labelnames != labelnames:
                    raise ValueError(f"metric {name!r} already registered as {existing.kind} "
                                     f"with labels {list(existing.labelnames)}")
                return existing
            m = cls(self, name, help, labelnames, **kw)
            self._metrics[name] = m
            return m

    def counter(self, name: str, help: str, labelnames: tuple[str, ...] | list[str] = ()) -> Counter:
        return self._register(Counter, name, help, labelnames)  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labelnames: tuple[str, ...] | list[str] = ()) -> Gauge:
        return self._register(Gauge, name, help, labelnames)  # type: ignore[return-value]

    def histogram(self, name: str, help: str, labelnames: tuple[str, ...] | list[str] = (),
                  buckets: tuple[float, ...] | list[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._register(Histogram, name, help, labelnames, buckets=tuple(buckets))  # type: ignore[return-value]

    def get(self, name: str) -> _Metric | None:
        with self._lock:
            return self._metrics.get(name)

    def render(self) -> str:
        with self._lock:
            metrics = [self._metrics[k] for k in sorted(self._metrics)]
            return "".join(m.render() + "\n" for m in metrics)


# ----------------------------------------------------------------------------------------- parsing
_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?$')
_PAIR_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(v: str) -> str:
    return re.sub(r'\\(.)', lambda m: {"n": "\n", "\\": "\\", '"': '"'}.get(m.group(1), m.group(0)), v)


def _parse_value(s: str) -> float:
    return {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(s) or float(s)


def parse_text(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of an exposition text: {(sample name, sorted label pairs): value}.
    Raises ValueError on a malformed line."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            raise ValueError(f"line {n}: not a sample: {line!r}")
        name, _, body, value = m.group(1), m.group(2), m.group(3), m.group(4)
        pairs: list[tuple[str, str]] = []
        if body:
            pos = 0
            while pos < len(body):
                pm = _PAIR_RE.match(body, pos)
                if not pm:
                    raise ValueError(f"line {n}: bad labels: {body!r}")
                pairs.append((pm.group(1), _unescape(pm.group(2))))
                pos = pm.end()
        out[(name, tuple(sorted(pairs)))] = _parse_value(value)
    return out


def sample(samples: dict, name: str, **labels: str) -> float | None:
    """Look one sample up in ``parse_text``'s result."""
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))
