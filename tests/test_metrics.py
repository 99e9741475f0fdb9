import math
import threading

import pytest

from coterie.node.metrics import Metrics, parse_text, sample


def test_counter_labels_render_and_parse():
    m = Metrics()
    c = m.counter("coterie_bytes_sent_total", "Bytes sent\nby kind", ("kind",))
    c.labels(kind="snapshot").inc(1024)
    c.labels(kind="snapshot").inc(1)
    c.labels(kind='we"ird\\').inc(2)
    rounds = m.counter("coterie_rounds_total", "Completed rounds")
    rounds.inc()
    rounds.inc(2)
    text = m.render()
    assert "# HELP coterie_bytes_sent_total Bytes sent\\nby kind\n" in text
    assert "# TYPE coterie_bytes_sent_total counter\n" in text
    assert 'coterie_bytes_sent_total{kind="snapshot"} 1025\n' in text
    assert "coterie_rounds_total 3\n" in text
    s = parse_text(text)
    assert sample(s, "coterie_bytes_sent_total", kind="snapshot") == 1025
    assert sample(s, "coterie_bytes_sent_total", kind='we"ird\\') == 2
    assert c.value(kind="snapshot") == 1025
    assert c.value(kind="never") == 0
    assert rounds.value() == 3


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
    plain = m.gauge("coterie_round", "Current round")
    plain.set(7.5)
    s = parse_text(m.render())
    assert sample(s, "coterie_peers", state="alive") == 2
    assert sample(s, "coterie_peers", state="dead") == 4
    assert sample(s, "coterie_round") == 7.5
    assert "# TYPE coterie_peers gauge" in m.render()


def test_histogram_buckets_sum_count():
    m = Metrics()
    h = m.histogram("coterie_request_seconds", "Latency", ("rpc",), buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.labels(rpc="Pull").observe(v)
    text = m.render()
    assert "# TYPE coterie_request_seconds histogram" in text
    s = parse_text(text)
    assert sample(s, "coterie_request_seconds_bucket", rpc="Pull", le="0.1") == 2  # le is inclusive
    assert sample(s, "coterie_request_seconds_bucket", rpc="Pull", le="1") == 3
    assert sample(s, "coterie_request_seconds_bucket", rpc="Pull", le="+Inf") == 4
    assert sample(s, "coterie_request_seconds_count", rpc="Pull") == 4
    assert math.isclose(sample(s, "coterie_request_seconds_sum", rpc="Pull"), 2.65)
    assert h.count(rpc="Pull") == 4 and h.count(rpc="Other") == 0
    # bucket lines come in increasing le order, then _sum and _count
    lines = [l for l in text.splitlines() if l.startswith("coterie_request_seconds")]
    assert [l.split(" ")[0].rsplit("_", 1)[-1].split("{")[0] for l in lines][-2:] == ["sum", "count"]
    plain = m.histogram("h_plain", "x", buckets=(1,))
    with plain.time():
        pass
    assert plain.count() == 1
    with pytest.raises(ValueError):
        m.histogram("h_le", "x", ("le",))


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
    assert c.value(kind="a") == 40000
    assert h.count() == 40000


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_text("this is not a sample line at all {")
    assert parse_text("# only comments\n\n") == {}
