"""Post-hoc, after ``never_worse.py sweep``: would a *paired* test on a node's own validation
split (per-sample differences of the same samples) have called collaboration worse where the
audit set shows it is, better than the check's unpaired accuracy margin? From each run's final
checkpoints under the sweep's ``--out``: collab = the node's own model (non-mixture strategies:
FedeRiCo is skipped), twin = its local reference; the val split rebuilt from the node's config.
Audit verdict: collab worse (gain + 2 SE < -1 point), better (gain - 2 SE > 0) or unclear.

    python bench/never_worse_paired.py [--out /tmp/never_worse]
"""

import argparse
import json
import math
from pathlib import Path

import tomllib
import torch

from coterie.node.collaboration_check import accuracy_margin
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.datasets import load_pool
from coterie.node.learning.partition import node_data
from coterie.node.modelfile import _build
from coterie.node.persistence import read_latest

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="/tmp/never_worse")
out = Path(ap.parse_args().out)
runs = Path(__file__).resolve().parent / "results" / "never_worse_runs.jsonl"
rows = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
nets = ("gaussian-perm", "s2", "digits-perm")
tally = {}
for r in rows:
    if r["network"] not in nets or r["strategy"] == "federico" or "failed" in r:
        continue
    base = out / f"{r['network']}-{r['strategy']}-{r['seed']}" / r["strategy"]
    for nid, n in r["nodes"].items():
        ck = read_latest(base / "nodes" / nid)
        card = {"format": "coterie-model/1", **ck.state["model"]}
        own = {k[len("learner/model/") :]: v for k, v in ck.tensors.items() if k.startswith("learner/model/")}
        tw = {k[len("model/") :]: v for k, v in ck.reference_state()[0].items() if k.startswith("model/")}
        cfg = LearnerConfig(**tomllib.loads((base / "configs" / f"{nid}.toml").read_text())["learner"])
        d = node_data(load_pool(cfg.dataset, cfg.dataset_params, cfg.data_seed), cfg)
        x = torch.as_tensor(d.x_val)
        with torch.no_grad():
            c = (_build(card, own, "", "")(x).argmax(1).numpy() == d.y_val).astype(float)
            t = (_build(card, tw, "", "")(x).argmax(1).numpy() == d.y_val).astype(float)
        nv = len(c)
        diff = c.mean() - t.mean()
        unpaired = diff < -accuracy_margin(c.mean(), t.mean(), nv, 1.0)
        sd = (c - t).std(ddof=1) if nv > 1 else 0
        paired = diff < -max(sd / math.sqrt(nv), 1.0 / nv)
        g, se = n["audit_collab_gain"], n["audit_collab_se"]
        truth = "worse" if g + 2 * se < -1 else ("better" if g - 2 * se > 0 else "unclear")
        k = (r["network"], truth)
        tt = tally.setdefault(k, [0, 0, 0])
        tt[0] += 1
        tt[1] += unpaired
        tt[2] += paired
for (w, truth), (m, u, p) in sorted(tally.items()):
    print(
        f"{w:14s} audit says collab {truth:8s}: {m:3d} node runs; last-round val check says worse: unpaired {u:3d}, paired {p:3d}"
    )
