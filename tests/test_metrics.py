import math
import threading

import pytest

from coterie.node.metrics import Metrics, build_info, parse_text, sample


def test_counter_labels_render_and_parse():
    m = Metrics()
    c = m.counter("coterie_sent_bytes_total", "Bytes sent\nby kind", ("kind",))
    c.labels(kind="snapshot").inc(1024)
    c.labels(kind="snapshot").inc(1)
    c.labels(kind='we"ird\\').inc(2)
    rounds = m.counter("coterie_rounds_total", "Completed rounds")
    rounds.inc()
    rounds.inc(2)
    text = m.render()
    assert "# HELP coterie_sent_bytes_total Bytes sent\\nby kind\n" in text
    assert "# TYPE coterie_sent_bytes_total counter\n" in text
    assert 'coterie_sent_bytes_total{kind="snapshot"} 1025.0\n' in text
    assert "coterie_rounds_total 3.0\n" in text
    assert "_created" not in text  # disabled: one series per metric, not two
    s = parse_text(text)
    assert sample(s, "coterie_sent_bytes_total", kind="snapshot") == 1025
    assert sample(s, "coterie_sent_bytes_total", kind='we"ird\\') == 2
    assert m.value("coterie_sent_bytes_total", kind="snapshot") == 1025
    assert m.value("coterie_sent_bytes_total", kind="never") is None
    assert m.value("coterie_rounds_total") == 3


def test_counter_rejects_bad_use():
    m = Metrics()
    c = m.counter("c_total", "x", ("kind",))
    with pytest.raises(ValueError):
        c.inc()  # labelled metric needs .labels()
    with pytest.raises(ValueError):
        c.labels(other="x")
    with pytest.raises(ValueError):
        c.labels(kind="a").inc(-1)
    with pytest.raises(ValueError):
        m.counter("bad name", "x")
    with pytest.raises(ValueError):
        m.gauge("c_total", "x", ("kind",))  # same name, other type
    assert m.counter("c_total", "x", ("kind",)) is c  # same definition: the same metric


def test_gauge():
    m = Metrics()
    g = m.gauge("coterie_peers", "Peers by state", ("state",))
    g.labels(state="alive").set(3)
    g.labels(state="alive").dec()
    g.labels(state="dead").inc(4)
    m.gauge("coterie_test_accuracy_ratio", "Accuracy").set(0.75)
    s = parse_text(m.render())
    assert sample(s, "coterie_peers", state="alive") == 2
    assert sample(s, "coterie_peers", state="dead") == 4
    assert sample(s, "coterie_test_accuracy_ratio") == 0.75
    assert "# TYPE coterie_peers gauge" in m.render()


def test_histogram_buckets_sum_count():
    m = Metrics()
    h = m.histogram("coterie_request_duration_seconds", "Latency", ("rpc",), buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.labels(rpc="Pull").observe(v)
    text = m.render()
    assert "# TYPE coterie_request_duration_seconds histogram" in text
    s = parse_text(text)
    name = "coterie_request_duration_seconds"
    assert sample(s, f"{name}_bucket", rpc="Pull", le="0.1") == 2  # le is inclusive
    assert sample(s, f"{name}_bucket", rpc="Pull", le="1.0") == 3
    assert sample(s, f"{name}_bucket", rpc="Pull", le="+Inf") == 4
    assert sample(s, f"{name}_count", rpc="Pull") == 4
    assert math.isclose(sample(s, f"{name}_sum", rpc="Pull"), 2.65)
    plain = m.histogram("h_plain", "x", buckets=(1,))
    with plain.time():
        pass
    assert m.value("h_plain_count") == 1
    with pytest.raises(ValueError):
        m.histogram("h_le", "x", ("le",))


def test_build_info_and_process_metrics():
    s = parse_text(Metrics().render())
    info = build_info()
    assert sample(s, "coterie_build_info", **info) == 1
    assert info["python"].count(".") == 2 and info["grpcio"] != "unknown"
    assert sample(s, "process_resident_memory_bytes") > 0
    assert sample(s, "process_cpu_seconds_total") >= 0


def test_registries_are_per_node():
    """Two nodes in one process (tests, the launcher's in-process helpers) must not collide or
    share counts: prometheus_client's global default registry would refuse the second."""
    a, b = Metrics(), Metrics()
    a.counter("coterie_rounds_total", "x").inc(5)
    b.counter("coterie_rounds_total", "x").inc(1)
    assert a.value("coterie_rounds_total") == 5 and b.value("coterie_rounds_total") == 1


def test_openmetrics_when_asked():
    m = Metrics(process=False)
    m.counter("coterie_rounds_total", "x").inc()
    body, ctype = m.exposition("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")
    body, ctype = m.exposition(None)
    assert ctype.startswith("text/plain; version=0.0.4") and b"# EOF" not in body


def test_thread_safe_increments():
    m = Metrics()
    c = m.counter("n_total", "x", ("kind",))
    h = m.histogram("lat", "x", buckets=(1,))

    def work():
        for _ in range(5000):
            c.labels(kind="a").inc()
            h.observe(0.5)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.value("n_total", kind="a") == 40000
    assert m.value("lat_count") == 40000


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_text("this is not a sample line at all {")
    assert parse_text("# only comments\n\n") == {}
