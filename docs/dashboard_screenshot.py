"""Make docs/dashboard.png: a 6-node FedFomo network on loopback (2 label-permutation clusters,
mnist1d), headless Chromium on n0's dashboard once every node has finished its rounds.

    python3 docs/dashboard_screenshot.py [--rounds 25] [--seed 0]

Needs Debian's chromium + chromium-driver and selenium (as tests/test_dashboard_browser.py)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from nodeproc import NodeProc, wait_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--out", type=Path, default=HERE / "dashboard.png")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="coterie-shot-"))
    nodes: list[NodeProc] = []
    try:
        for i in range(a.nodes):
            learner = {
                "dataset": "mnist1d",
                "dataset_params": {"num_samples": 4000},
                "partition": "label_permutation",
                "partition_params": {"num_clusters": 2},
                "num_nodes": a.nodes,
                "node_index": i,
                "model": "mlp",
                "optimizer": "adam",
                "lr": 0.003,
                "local_steps": 20,
                "data_seed": a.seed,
                "init_seed": a.seed,
            }
            cfg = {
                "strategy": "fedfomo",
                "rounds": a.rounds,
                "min_peers": a.nodes - 1,
                "start_timeout_s": 120,
                "seed": a.seed + i,
                "learner": learner,
                "peers": [nodes[-1].address] if nodes else [],
            }
            nodes.append(NodeProc(root, f"n{i}", cfg).start(timeout=180))
        for n in nodes:
            wait_for(lambda n=n: n.status()["done"], 600, f"{n.node_id} to finish")
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium")
        for flag in (
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--window-size=1400,1250",
            "--hide-scrollbars",
        ):
            opts.add_argument(flag)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
        try:
            driver.get(f"{nodes[0].admin}/?token={nodes[0].token}")  # the admin token's dashboard bootstrap
            wait_for(
                lambda: len(driver.find_elements("css selector", "#heatmap rect.cell")) == a.nodes * (a.nodes - 1),
                30,
                "the heatmap",
            )
            raw = root / "raw.png"
            driver.save_screenshot(str(raw))
        finally:
            driver.quit()
        from PIL import Image  # shipped with matplotlib

        img = Image.open(raw).convert("RGB")
        img = img.resize((1100, round(img.height * 1100 / img.width)), Image.LANCZOS)
        img.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(a.out, optimize=True)
        print(f"{a.out}: {a.out.stat().st_size / 1e3:.0f} kB")
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
