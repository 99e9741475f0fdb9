"""The dashboard in a real browser: headless Chromium (Debian's chromium + chromium-driver, driven
by selenium) loads the admin page of a node in a running 3-node network and must draw the
accuracy/loss/weights charts, the network heatmap and the traffic bars from live data.

A screenshot goes to $ARTIFACTS_DIR (default: artifacts/ in the repository) for CI to keep.
Skipped only when no chromium/chromedriver is installed (``.ci/run`` installs both)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.nodeproc import NodeProc, tiny_learner, wait_for

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ROUNDS = 6
ARTIFACTS = Path(os.environ.get("ARTIFACTS_DIR") or Path(__file__).resolve().parents[1] / "artifacts")


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """n0 <- n1 <- n2, oracle strategy over two true clusters (n0, n1 | n2): weights form blocks."""
    root = tmp_path_factory.mktemp("dash")
    nodes: list[NodeProc] = []
    try:
        for i in range(3):
            cfg = {
                "strategy": "oracle",
                "rounds": ROUNDS,
                "min_peers": 2,
                "start_timeout_s": 60,
                "learner": tiny_learner(3, i, clusters=2),
                "peers": [nodes[-1].address] if nodes else [],
            }
            nodes.append(NodeProc(root, f"n{i}", cfg).start())
        for n in nodes:
            wait_for(lambda n=n: n.status()["done"], 120, f"{n.node_id} to finish {ROUNDS} rounds")
        yield nodes
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium + chromedriver installed (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--window-size=1400,1500",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _attrs(driver, css: str, *names: str) -> list[dict[str, str | None]]:
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => Object.fromEntries("
        "arguments[1].map(n => [n, e.getAttribute(n)])))",
        css,
        list(names),
    )


def test_dashboard_draws_live_network(network, browser):
    n0 = network[0]
    for peer in network[1:]:  # the user's credentials for each peer: the browser reads their rows itself
        browser.get(f"{peer.admin}/?token={peer.token}")
        wait_for(lambda p=peer: browser.current_url.rstrip("/") == p.admin, 10, "the peer's token redirect")
    browser.get(f"{n0.admin}/?token={n0.token}")  # the bootstrap: a cookie, then / without the token
    wait_for(lambda: browser.current_url.rstrip("/") == n0.admin, 10, "the redirect to / without the token")

    def drawn():
        cells = _attrs(browser, "#heatmap rect.cell", "data-row", "data-col", "data-value")
        acc = _attrs(browser, "#acc-chart path.line", "data-n", "data-last", "d")
        return len(cells) == 6 and acc and int(acc[0]["data-n"]) == ROUNDS and (cells, acc)

    cells, acc = wait_for(drawn, 30, "the dashboard to draw the heatmap and the accuracy chart")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    # accuracy: one point per round of /history, the last one the node's own last test accuracy
    history = n0.get("/history")
    assert len(history) == ROUNDS
    assert float(acc[0]["data-last"]) == pytest.approx(history[-1]["eval"]["test_acc"])
    assert acc[0]["d"].count("L") == ROUNDS - 1  # a polyline through every round
    loss = _attrs(browser, "#loss-chart path.line", "data-series", "data-n")
    assert {p["data-series"] for p in loss} == {"train loss", "test loss"}
    assert all(int(p["data-n"]) == ROUNDS for p in loss)
    weights = _attrs(browser, "#weights-chart path.line", "data-series", "data-n")
    assert len(weights) >= 2 and all(int(w["data-n"]) == ROUNDS for w in weights)

    # heatmap: the 3x3 network matrix without its diagonal, each row the mean of that node's last
    # rounds as its own /history reports them (the browser fetched them; the node fetches nothing)
    net = n0.get("/network")
    assert sorted([net["node_id"], *(p["node_id"] for p in net["peers"])]) == ["n0", "n1", "n2"]
    rows = {}
    for n in network:
        hist = [h["weights"] for h in n.get(f"/history?last={net['rounds_averaged']}")]
        rows[n.node_id] = {k: sum(w.get(k, 0.0) for w in hist) / len(hist) for k in ("n0", "n1", "n2")}
    rows_shown = _attrs(browser, "#heatmap text[data-row]", "data-row")
    idx = {r["data-row"]: i for i, r in enumerate(rows_shown)}
    for c in cells:
        assert c["data-row"] != c["data-col"]
        assert float(c["data-value"]) == pytest.approx(rows[c["data-row"]][c["data-col"]])
    by = {(c["data-row"], c["data-col"]): float(c["data-value"]) for c in cells}
    # oracle: n0 and n1 (cluster 0) weight each other, nobody weights across clusters
    assert by[("n0", "n1")] > 0 and by[("n1", "n0")] > 0
    assert by[("n0", "n2")] == by[("n2", "n0")] == by[("n1", "n2")] == 0
    # rows in block order: the two cluster-0 nodes are adjacent
    assert abs(idx["n0"] - idx["n1"]) == 1
    selfs = _attrs(browser, "#heatmap rect.self", "data-row", "data-value")
    assert len(selfs) == 3 and all(0 < float(s["data-value"]) <= 1 for s in selfs)
    fills = browser.execute_script(
        "return [...document.querySelectorAll('#heatmap rect.cell')].map(e => e.getAttribute('fill'))"
    )
    assert len(set(fills)) >= 2  # weighted and unweighted peers are drawn differently

    # traffic: bars with bytes for the snapshots the nodes pulled from each other
    bars = _attrs(browser, "#traffic rect.bar", "data-kind", "data-dir", "data-bytes")
    assert any(float(b["data-bytes"]) > 0 for b in bars)
    # peers table and header
    states = browser.execute_script(
        "return [...document.querySelectorAll('#peers tbody tr td:nth-child(3)')].map(e => e.textContent)"
    )
    # both peers listed with a state (alive, or suspect for a moment on a loaded machine)
    assert len(states) == 2 and set(states) <= {"alive", "suspect"}
    assert browser.find_element("id", "h-round").text.startswith(str(ROUNDS))
    assert browser.find_element("id", "err").text == ""
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
