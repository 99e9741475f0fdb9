"""Probe (issue 33, helper cobosteps): COBO's mean raw pair weights per round, same-cluster / other-cluster,
on S1 (bench/never_worse.py's 8-node S1, seed 0, 30 rounds), warm phase pinned at 40,000 steps
against the node's planned run (600 steps). One run each, one after the other. As run it wrote
/tmp/cobosteps_probe.json, copied to bench/results/never_worse_cobo_w_by_round.json; the
scenario's full config is the s1 line of bench/results/never_worse_cobo_steps.jsonl (``config``)."""

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import never_worse as nw

from coterie.lab.launch import run_scenario

nw.ROUNDS = 30
out = {}
for label, params in (("pinned", {"total_steps": 40000}), ("planned", {})):
    sc = nw.scenario("s1", "cobo", 0)
    sc.strategy_params.setdefault("cobo", {}).update(params)
    with tempfile.TemporaryDirectory() as d:
        res = run_scenario(sc, Path(d), backend="inproc", check=False)
    s = res["strategies"]["cobo"]
    ids = sorted(s["nodes"])
    cl = {n: int(s["nodes"][n]["true_cluster"]) for n in ids}
    wm = s["weights"]
    rows = []
    for r, mat in zip(wm["rounds"], wm["matrices"], strict=True):
        same, other = [], []
        for i, n in enumerate(ids):
            row = mat[i]
            if not row or not row[i]:
                continue
            for j, m in enumerate(ids):
                if m == n:
                    continue
                (same if cl[m] == cl[n] else other).append(row[j] / row[i])  # raw w_nm (self = 1)
        rows.append((r, statistics.fmean(same) if same else None, statistics.fmean(other) if other else None))
    out[label] = rows
    print(label, " ".join(f"r{r}:{a:.2f}/{b:.2f}" for r, a, b in rows if a is not None), flush=True)
json.dump(out, open("/tmp/cobosteps_probe.json", "w"))
